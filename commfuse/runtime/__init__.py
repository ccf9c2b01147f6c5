"""What runs a fused call: group state and symmetric workspaces, the policy and its rules, the paths.

``entry.py`` is where a call comes in; ``policy.py`` chooses its path from the rules of the group's
GPU (``rules.py``, data in ``rules/``) and the group's agreed facts (``facts.py``); ``paths/`` holds
one module per path; ``groups.py`` the per-group state, ``workspace.py`` its buffers and
``capture.py`` what CUDA-graph capture changes; ``counters.py`` what the run-time counts;
``plans.py`` what compiled graphs tell the run-time. Importing this package imports none of them
(some bring Triton).
"""
