"""Framework adapters (TRL, verl, SkyRL, torchtitan). Import the submodule you need: each imports its framework
lazily."""
