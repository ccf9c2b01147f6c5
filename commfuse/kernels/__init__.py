"""Triton device code and each kernel's launcher: no policy, no settings, no workspace management.

A launcher reads what it needs of a workspace from the object it is handed (its flags, heap bases,
rank, error word and wait bound) and takes every other choice as an argument.
"""
