"""``ClassRegistry``: classes registered by name, the shape of the storage-layout and byte-codec registries.

Each registry keeps a ``{name: class}`` mapping in registration order, checks that what is registered is a subclass
of its base, sets the class's ``name``, and refuses an unknown name with a ``ConfigError`` that lists the registered
ones (the message a user sees for ``SwapConfig(layout=...)`` or ``SwapConfig(codec=...)``).
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from ..errors import ConfigError

T = TypeVar("T", bound=type)


class ClassRegistry(Generic[T]):
    """Subclasses of ``base`` registered by name.

    Args:
        base: The class every registered one derives from.
        kind: What one is, for messages ("byte codec").
        key: The ``SwapConfig`` key that names one ("codec").
        decorator: The public name of ``register``, for messages ("register_codec").
    """

    def __init__(self, base: type, kind: str, key: str, decorator: str):
        self.base, self.kind, self.key, self.decorator = base, kind, key, decorator
        self.classes: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """A class decorator registering a subclass of ``base`` as ``name``.

        Args:
            name: A non-empty string not registered yet.

        Returns:
            The decorator (it returns the class unchanged, its ``name`` set).

        Raises:
            ValueError: When ``name`` is empty or already taken.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.decorator}: expected a non-empty name, got {name!r}")
        if name in self.classes:
            raise ValueError(
                f"{self.decorator}: a {self.kind} named {name!r} is registered already ({self.classes[name]!r})"
            )

        def register(cls: T) -> T:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"{self.decorator}({name!r}): {cls!r} is not a {self.base.__name__} subclass")
            cls.name = name  # type: ignore[attr-defined]
            self.classes[name] = cls
            return cls

        return register

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a test's toy); unknown names are ignored.

        Args:
            name: A registered name.
        """
        self.classes.pop(name, None)

    def get(self, name: str) -> T:
        """The class registered as ``name``.

        Args:
            name: The name.

        Returns:
            The class.

        Raises:
            ConfigError: When nothing has that name (the message lists what does).
        """
        cls = self.classes.get(name)
        if cls is None:
            raise ConfigError(f"{self.key}: no {self.kind} named {name!r}; registered: {', '.join(self.names())}")
        return cls

    def names(self) -> list[str]:
        """The registered names, in registration order.

        Returns:
            The names.
        """
        return list(self.classes)
