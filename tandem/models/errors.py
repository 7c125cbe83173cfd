"""The one error a checkpoint that cannot be served raises, whatever its format."""


class ModelLoadError(ValueError):
    """A checkpoint that cannot be served: the message names the file or field at fault."""
