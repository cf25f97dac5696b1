"""Framework adapters (TRL, verl). Import the submodule you need: each imports its framework lazily."""
