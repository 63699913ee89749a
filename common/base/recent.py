"""A bounded memory of the latest keys: what a node remembers of requests it is done
with, so that a late or repeated message about one is answered right."""

from __future__ import annotations

from collections import OrderedDict


class Recent:
    """The last `size` keys added, each with a value; the oldest is forgotten first."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict = OrderedDict()

    def add(self, key, value=None) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, key, default=None):
        return self._items.get(key, default)

    def __contains__(self, key) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
