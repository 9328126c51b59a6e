"""The one error type of the data package."""


class DataError(ValueError):
    """A data file is missing, unreadable, or lacks what the config asks for."""
