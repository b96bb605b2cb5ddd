"""Errors the planner raises for bad input (as opposed to bugs)."""


class ConfigError(ValueError):
    """A config or cost table that cannot be used; ``str()`` is one line per problem."""


class LayoutError(ValueError):
    """A layout that cannot run at all (wrong size, or no split that fits in memory)."""
