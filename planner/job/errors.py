"""Errors the planner raises for bad input (as opposed to bugs)."""


class ConfigError(ValueError):
    """A config or cost table that cannot be used; ``str()`` is one line per problem."""
