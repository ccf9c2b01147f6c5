"""What runs a fused call: group state and symmetric workspaces, the policy and its rules, the paths.

``entry.py`` is where a call comes in; ``policy.py`` chooses its path from the rules of the group's
GPU (``rules.py``, data in ``rules/``) and the group's agreed facts (``facts.py``); ``paths/`` holds
one module per path; ``groups.py`` and ``workspace.py`` the per-group state and buffers. Importing
this package imports none of them (they bring Triton).
"""
