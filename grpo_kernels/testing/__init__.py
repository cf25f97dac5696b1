"""Test helpers shipped with the package: AOT compilation of Triton launches for GPU targets without a GPU."""
