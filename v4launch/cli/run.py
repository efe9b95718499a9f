"""`v4launch run` (being written)."""

HELP = "run (not yet available)"
EXAMPLES = ""


def run() -> None:
    """Not yet available."""
    raise NotImplementedError("v4launch run is not implemented yet")
