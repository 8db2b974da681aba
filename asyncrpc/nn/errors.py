"""The errors ``RemoteModule`` raises for what it refuses to do (layer L4).

Both derive from ``AsyncRpcError`` and from the builtin type torch raises in the same case,
so torch-style ``except ValueError`` / ``except RuntimeError`` handlers keep working.
"""

from __future__ import annotations

from asyncrpc.errors import AsyncRpcError

__all__ = ["ScriptRemoteModuleError", "UnsupportedMethodError"]


class UnsupportedMethodError(AsyncRpcError, ValueError):
    """An ``nn.Module`` method a ``RemoteModule`` cannot offer (the module is elsewhere).

    Carries ``method``, the refused method's name.
    """

    def __init__(self, method: str, hint: str = "") -> None:
        super().__init__(method, hint)
        self.method = method
        self.hint = hint

    def __str__(self) -> str:
        # torch's wording, which torch's own tests and users' handlers match.
        text = f"Method ``{self.method}`` not supported for RemoteModule"
        return f"{text}. {self.hint}" if self.hint else text


class ScriptRemoteModuleError(AsyncRpcError, NotImplementedError):
    """A TorchScript-interface ``RemoteModule`` was asked for (``_module_interface_cls``).

    TorchScript only types torch's own C++ ``RRef``; an asyncrpc ``RRef`` is a Python object
    it cannot compile, so the scripted template's ``module_rref.owner()`` and
    ``rpc_async`` calls have nothing to bind to.
    """
