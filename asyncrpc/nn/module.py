"""``RemoteModule``: a local ``nn.Module`` handle whose module runs on another worker (L4).

The module is built on its owner with ``asyncrpc.remote``; the handle keeps the ``RRef`` and
calls the owner with ``rpc_sync``/``rpc_async``, so it works over the real agent, under
distributed autograd, and from any worker the handle is sent to. Semantics follow
``torch.distributed.nn.RemoteModule``.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any, NoReturn

from torch import nn

from asyncrpc.api import get_worker_info, remote, rpc_sync
from asyncrpc.errors import SerializationError
from asyncrpc.nn.device import parse_remote_device
from asyncrpc.nn.errors import ScriptRemoteModuleError, UnsupportedMethodError
from asyncrpc.nn.methods import GENERATED_METHODS
from asyncrpc.nn.owner import create_module, parameter_rrefs, set_training
from asyncrpc.protocol.serde import register_reducer
from asyncrpc.rref.handle import RRef
from asyncrpc.runtime.cuda.feature import CudaFeature
from asyncrpc.runtime.current import FeatureSlot
from asyncrpc.runtime.futures import Future

__all__ = ["REMOTE_MODULE_PICKLED_ATTRIBUTES", "RemoteModule"]

_CUDA: FeatureSlot[CudaFeature] = FeatureSlot("cuda", "device maps")

logger = logging.getLogger(__name__)

REMOTE_MODULE_PICKLED_ATTRIBUTES = (
    "on",
    "device",
    "is_device_map_set",
    "is_scriptable",
    "generated_methods",
    "module_rref",
)
"""The attributes a ``RemoteModule`` carries when sent over RPC, in this order."""

# What nn.Module.__init__ sets, read from the installed torch rather than listed by hand:
# these stay behind quietly when a RemoteModule is sent (the receiver has no local module
# state to rebuild); any other attribute a user adds is dropped with a warning.
_GENERATED_NAMES = frozenset(method.__name__ for method in GENERATED_METHODS)
_LEFT_BEHIND = frozenset(vars(nn.Module())) | _GENERATED_NAMES

# nn.Module methods that would act on local state a RemoteModule does not have.
_REFUSED = (
    "register_buffer", "register_parameter", "add_module", "apply", "cuda", "ipu", "xpu",
    "cpu", "type", "float", "double", "half", "bfloat16", "to", "register_backward_hook",
    "register_full_backward_hook", "register_full_backward_pre_hook",
    "register_forward_pre_hook", "register_forward_hook", "state_dict", "load_state_dict",
    "parameters", "named_parameters", "buffers", "named_buffers", "children",
    "named_children", "modules", "named_modules", "requires_grad_", "zero_grad",
    "share_memory", "extra_repr",
)  # fmt: skip
_HINTS = {"parameters": "Please use ``remote_parameters`` instead."}


class RemoteModule(nn.Module):
    """An ``nn.Module`` whose ``forward`` runs on the worker that owns the real module.

    ``RemoteModule(remote_device, module_cls, args=None, kwargs=None)`` builds
    ``module_cls(*args, **kwargs)`` on the worker named in ``remote_device`` and places it on
    the device named there. ``forward(*args, **kwargs)`` blocks for the result;
    ``forward_async(...)`` returns an ``asyncrpc.Future`` (``wait()`` it, or ``await`` it).
    ``remote_parameters()`` gives RRefs for ``DistributedOptimizer``. Methods that need the
    module's local state (``parameters``, ``to``, ``state_dict``...) raise
    ``UnsupportedMethodError``. Sending a RemoteModule in an RPC sends a handle to the same
    module; pickling it any other way raises ``SerializationError``.

    Args:
        remote_device: ``"<workername>/<device>"``, ``"rank:<rank>/<device>"`` or
            ``"<workername>"`` (device ``cpu``).
        module_cls: the module class (or any callable returning an ``nn.Module``).
        args: positional arguments of ``module_cls``.
        kwargs: keyword arguments of ``module_cls``.
        _module_interface_cls: torch's TorchScript interface option; not supported.

    Raises:
        ValueError, RuntimeError: a malformed ``remote_device``.
        NotInitializedError: RPC is not initialized here.
        UnknownWorkerError: no such worker.
        ScriptRemoteModuleError: ``_module_interface_cls`` was given.
        Exception: the constructor's own errors (and a ``ValueError`` if it does not
            return an ``nn.Module``) surface, with their original type, on the first
            ``forward``.
    """

    forward_async: Callable[..., Future[Any]]
    on: str | int
    device: str
    is_device_map_set: bool
    is_scriptable: bool
    generated_methods: tuple[Callable[..., Any], ...]
    module_rref: RRef[nn.Module]

    def __init__(
        self,
        remote_device: str,
        module_cls: Callable[..., nn.Module],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        _module_interface_cls: Any = None,
    ) -> None:
        super().__init__()
        _refuse_script(_module_interface_cls)
        self._place(remote_device)
        self.is_scriptable = False
        self.generated_methods = GENERATED_METHODS
        self.module_rref = remote(
            self.on, create_module, (module_cls, tuple(args or ()), dict(kwargs or {}), self.device)
        )
        self._install_methods()

    @staticmethod
    def init_from_module_rref(
        remote_device: str, module_rref: RRef[nn.Module], _module_interface_cls: Any = None
    ) -> RemoteModule:
        """Build a RemoteModule over an existing module ``RRef`` (sharing that module).

        The way to hand a module to another worker without sending the RemoteModule:
        send ``get_module_rref()`` and call this there.

        Args:
            remote_device: where the module lives, as in the constructor.
            module_rref: an ``RRef`` to an ``nn.Module``.
            _module_interface_cls: not supported, as in the constructor.

        Returns:
            A RemoteModule whose ``forward`` runs the module behind ``module_rref``.

        Raises:
            ScriptRemoteModuleError: ``_module_interface_cls`` was given.
            ValueError, RuntimeError: a malformed ``remote_device``.
            NotInitializedError, UnknownWorkerError: as in the constructor.
        """
        _refuse_script(_module_interface_cls)
        handle: RemoteModule = object.__new__(RemoteModule)
        handle._place(remote_device)
        handle.is_scriptable = False
        handle.generated_methods = GENERATED_METHODS
        handle.module_rref = module_rref
        handle._install_methods()
        return handle

    # The generated methods (forward, forward_async) are listed in the instance's __dict__,
    # as torch's are (its tests read a received RemoteModule's attributes), but as plain
    # functions: a method bound to the instance and stored in it would make every
    # RemoteModule a reference cycle, and one dropped on a worker whose garbage collector
    # does not happen to run would keep its module RRef (and the owner's module) alive.
    # Reading one binds it afresh, so it holds its RemoteModule as long as it is held.
    def _install_methods(self) -> None:
        for method in self.generated_methods:
            self.__dict__[method.__name__] = method

    def __getattribute__(self, name: str) -> Any:
        if name in _GENERATED_NAMES:
            method = object.__getattribute__(self, "__dict__").get(name)
            if method is not None:
                return types.MethodType(method, self)
        return super().__getattribute__(name)

    def _place(self, remote_device: str) -> None:
        where = parse_remote_device(remote_device)
        maps = _CUDA.get().device_maps  # NotInitializedError before anything else
        self.on = where.on
        self.device = where.device
        self.is_device_map_set = bool(maps.get(get_worker_info(where.on).name))

    def remote_parameters(self, recurse: bool = True) -> list[RRef[nn.Parameter]]:
        """RRefs to the remote module's parameters, for ``DistributedOptimizer``.

        Args:
            recurse: include the parameters of submodules.

        Returns:
            One ``RRef`` per parameter, owned by the module's worker. Blocks.

        Raises:
            Exception: the module's construction error, and the errors of ``rpc_sync``.
        """
        owner = self.module_rref.owner_name()
        rrefs: list[RRef[nn.Parameter]] = rpc_sync(
            owner, parameter_rrefs, (self.module_rref, recurse)
        )
        return rrefs

    def get_module_rref(self) -> RRef[nn.Module]:
        """The ``RRef`` to the remote module."""
        return self.module_rref

    def train(self, mode: bool = True) -> RemoteModule:
        """Set the remote module's training mode (blocks until the owner has).

        Args:
            mode: True for training, False for evaluation.

        Returns:
            This RemoteModule (torch's returns a copy of the remote module instead).
        """
        rpc_sync(self.module_rref.owner_name(), set_training, (self.module_rref, mode))
        self.training = mode
        return self

    def eval(self) -> RemoteModule:
        """Put the remote module in evaluation mode; ``train(False)``."""
        return self.train(False)

    def __getstate__(self) -> NoReturn:
        # Only the RPC pickler knows how to send the module RRef; it uses _reduce below.
        raise SerializationError(
            "Cannot pickle RemoteModule in python pickler. "
            "RemoteModule can only be pickled when using RPC"
        )

    def __setstate__(self, state: Any) -> NoReturn:
        raise SerializationError(
            "Cannot unpickle RemoteModule in python pickler. "
            "RemoteModule can only be unpickled when using RPC"
        )

    def __repr__(self) -> str:
        # nn.Module's repr calls extra_repr, which a RemoteModule refuses.
        state = self.__dict__
        where = f"on={state.get('on')!r}, device={state.get('device')!r}"
        return f"RemoteModule({where}, module_rref={state.get('module_rref')!r})"


def _refuse_script(module_interface_cls: Any) -> None:
    if module_interface_cls is not None:
        raise ScriptRemoteModuleError(
            "TorchScript RemoteModules (_module_interface_cls) are not supported: TorchScript "
            "cannot type asyncrpc's RRef. Use a Python RemoteModule (no _module_interface_cls)."
        )


def _refusal(name: str) -> Callable[..., NoReturn]:
    hint = _HINTS.get(name, "")

    def refused(self: RemoteModule, *args: Any, **kwargs: Any) -> NoReturn:
        raise UnsupportedMethodError(name, hint)

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Refused: ``{name}`` needs the module's local state, which is remote."
    return refused


for _name in _REFUSED:
    setattr(RemoteModule, _name, _refusal(_name))


def _reduce(handle: RemoteModule) -> tuple[Any, ...]:
    """Reduce a RemoteModule to its pickled attributes (the RPC pickler's hook)."""
    state = handle.__dict__
    for name in state.keys() - set(REMOTE_MODULE_PICKLED_ATTRIBUTES) - _LEFT_BEHIND:
        logger.warning("RemoteModule attribute %r is not sent over RPC", name)
    return _rebuild, tuple(state[name] for name in REMOTE_MODULE_PICKLED_ATTRIBUTES)


def _rebuild(*values: Any) -> RemoteModule:
    """Rebuild a RemoteModule on the receiving worker, with its generated methods."""
    handle: RemoteModule = object.__new__(RemoteModule)
    handle.__dict__.update(zip(REMOTE_MODULE_PICKLED_ATTRIBUTES, values, strict=True))
    handle._install_methods()
    return handle


register_reducer(RemoteModule, _reduce)
