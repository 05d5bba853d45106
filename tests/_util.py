"""Helpers shared by tests."""


def all_numbers(obj):
    """Every int/float (not bool) inside nested dicts and lists."""
    if isinstance(obj, dict):
        for v in obj.values():
            yield from all_numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from all_numbers(v)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield obj
