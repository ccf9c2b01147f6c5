"""``python -m commfuse explain ...`` (the only command for now)."""

import sys

USAGE = "usage: python -m commfuse explain [--help] [options]"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        print("  explain   show which matmul/collective pairs of a TP model fuse, and why the others do not")
        return 0 if argv else 2
    if argv[0] != "explain":
        print(f"unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    from .explain import main as explain

    return explain(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
