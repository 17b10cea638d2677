"""Sub-commands that span several layers (plan, simulate); each exposes add_arguments and run."""
