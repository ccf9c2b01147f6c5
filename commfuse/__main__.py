"""``python -m commfuse COMMAND ...``: the package's commands, each parsing its own options.

Only the chosen command imports what it needs (the backend imports Dynamo and Inductor), so
``--help`` answers at once.
"""

import sys

#: command: (module, one line for the help)
COMMANDS = {
    "explain": ("commfuse.tools.explain", "show which matmul/collective pairs of a TP model fuse, why the others "
                "do not, and which path each fused call would take on a given GPU (CPU, one process)"),
    "bench": ("commfuse.tools.bench", "time the ops against unfused cuBLAS + NCCL (bench ops: CUDA GPUs, under "
              "torchrun) or a TP model per backend (bench model: under torchrun, GPUs or CPU ranks)"),
    "tune": ("commfuse.tools.tune", "measured dispatch: tune every call a script or the bundled model makes "
             "(CUDA GPUs, under torchrun); --show / --clear this machine's tuning cache"),
}

USAGE = "usage: python -m commfuse {" + ",".join(COMMANDS) + "} [--help] [options]"


def _help() -> str:
    lines = [USAGE, "", "commands:"]
    lines += [f"  {name:<9} {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "python -m commfuse COMMAND --help shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_help(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    import importlib

    from commfuse import env

    prog = f"python -m commfuse {argv[0]}"
    _short_warnings(prog)
    try:  # a malformed COMMFUSE_* setting: its one line before any work, not a traceback from inside it
        if not {"-h", "--help"} & set(argv[1:]):
            env.validate()
        module = importlib.import_module(COMMANDS[argv[0]][0])
        return module.main(argv[1:], prog=prog)
    except (ValueError, TypeError, OSError) as exc:
        _leave_group()
        if not _user_error(exc):
            raise
        print(f"{prog}: {_one_line(exc)}", file=sys.stderr)
        return 2
    except BaseException:
        _leave_group()
        raise


def _leave_group() -> None:
    """A command that failed under torchrun leaves its process group before the interpreter's
    teardown (``commfuse.demo.shutdown``; no barrier: a peer may not get that far)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from commfuse.demo import shutdown

        shutdown(agree=False)


def _short_warnings(prog: str) -> None:
    """commfuse's warnings as one line naming the command: on the command line the frame a warning
    points at is runpy's, not the user's."""
    import warnings

    default = warnings.showwarning
    if getattr(default, "_commfuse", False):  # main() called again in one process
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if str(message).startswith("commfuse"):
            print(f"{prog}: warning: {_one_line(message)}", file=file or sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    show._commfuse = True
    warnings.showwarning = show


def _user_error(exc: Exception) -> bool:
    """What a user got wrong: a bad ``COMMFUSE_*`` value or argument (commfuse's ``ValueError`` /
    ``TypeError``, whose messages start with ``commfuse``) or a file that cannot be read."""
    if isinstance(exc, OSError):
        return exc.filename is not None
    return str(exc).startswith("commfuse")


def _one_line(exc: Exception) -> str:
    if isinstance(exc, OSError):
        return f"{exc.strerror or type(exc).__name__}: {exc.filename}"
    text = " ".join(str(exc).split())
    return text[len("commfuse: "):] if text.startswith("commfuse: ") else text


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
