"""Each kernel's sizes, tilings and options as plain Python: what a path decides a call from, with
no Triton import (the kernels import these and add their device code)."""
