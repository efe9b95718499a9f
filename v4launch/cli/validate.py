"""`v4launch validate` (being written)."""

HELP = "validate (not yet available)"
EXAMPLES = ""


def validate() -> None:
    """Not yet available."""
    raise NotImplementedError("v4launch validate is not implemented yet")
