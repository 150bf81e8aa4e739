"""Errors jaxlp raises for bad user input, each naming the file or option at fault."""


class CheckpointFormatError(ValueError):
    """A model directory that is missing files or holds tensors that do not fit the config."""


class UnsupportedConfigError(ValueError):
    """A config.json option that changes the math and that jaxlp does not implement."""
