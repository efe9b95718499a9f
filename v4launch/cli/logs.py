"""`v4launch logs` (being written)."""

HELP = "logs (not yet available)"
EXAMPLES = ""


def logs() -> None:
    """Not yet available."""
    raise NotImplementedError("v4launch logs is not implemented yet")
