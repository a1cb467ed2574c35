"""The one warning category of batchwidgets, so users can filter it."""


class BatchwidgetsWarning(UserWarning):
    """Something in the user's setup makes a batchwidgets measurement or result less exact."""
