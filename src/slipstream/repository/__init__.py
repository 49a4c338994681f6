"""Reading a Triton-style model repository and completing model configs."""
