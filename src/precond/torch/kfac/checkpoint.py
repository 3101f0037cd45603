"""K-FAC's checkpoints: ``state_dict`` (factors, and the second-order data in
use, so a restored run continues bit for bit) and ``load_state_dict`` (precond's
format or KAISA 0.4's), checked whole before anything changes."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from precond._common.validation import check_int
from precond.torch.kfac.arguments import _ARGUMENT_CHECKS

if TYPE_CHECKING:
    from precond.torch.kfac.assignment import LayerWork, WorkerGrid
    from precond.torch.kfac.communication import Communicator
    from precond.torch.kfac.layers import KFACLayer

logger = logging.getLogger("precond.torch.kfac")


class Checkpointing:
    """:class:`~precond.torch.kfac.KFAC`'s ``state_dict`` and ``load_state_dict``
    (a mixin: it reads the preconditioner's layers, worker grid and assignment,
    and recomputes second-order data with its ``_update_second_order``)."""

    _HYPERPARAMETERS = (
        "factor_update_steps",
        "inv_update_steps",
        "damping",
        "factor_decay",
        "kl_clip",
        "lr",
    )

    # What the mixin reads from KFAC (annotations only: KFAC sets them).
    param_groups: list[dict[str, Any]]
    layers: list[KFACLayer]
    grid: WorkerGrid
    communicator: Communicator
    assignment: dict[str, LayerWork]
    loglevel: int
    inv_dtype: torch.dtype

    if TYPE_CHECKING:  # KFAC's methods the mixin calls

        def _dtype(self, layer: KFACLayer) -> torch.dtype: ...

        def _second_order_layout(
            self, layer: KFACLayer
        ) -> list[tuple[str, str, tuple]]: ...

        def _update_second_order(self) -> None: ...

    def state_dict(self, include_factors: bool = True) -> dict[str, Any]:
        """What :meth:`load_state_dict` needs to continue the run exactly.

        KAISA's keys: ``steps``, the hyperparameters that are not callables, and
        (with ``include_factors``, the default) ``layers``: every layer's running
        factors ``{"A": ..., "G": ...}`` by name. precond adds, with the factors,
        ``second_order``: the decompositions (or inverses) this rank holds, by layer
        name, as computed at the last inverse-update step, and ``ready``: the names
        of the layers that had them. They were computed from the factors of that
        step, which later factor updates have changed, so recomputing them from the
        saved factors would not continue the run as it would have gone on; loading
        them does, bit for bit, whatever the step of the checkpoint.

        Every tensor is a copy; the dict holds only tensors, numbers, strings,
        lists and dicts, so ``torch.save``/``torch.load(weights_only=True)``,
        ``copy.deepcopy`` and ``pickle`` all work. Data parallel: save rank 0's
        dict; with ``grad_worker_fraction < 1`` a rank holds the second-order
        data of its own column only, and ranks of other columns recompute theirs
        from the factors on load (see :meth:`load_state_dict`).
        """
        state: dict[str, Any] = {"steps": self._steps}
        for name in self._HYPERPARAMETERS:
            value = self.param_groups[0][name]
            if not callable(value):
                state[name] = value
        if include_factors:
            state["layers"] = {
                l.name: {
                    "A": None if l.A is None else l.A.clone(),
                    "G": None if l.G is None else l.G.clone(),
                }
                for l in self.layers
            }
            state["ready"] = [l.name for l in self.layers if self._ready[l.name]]
            state["second_order"] = {
                l.name: {key: t.clone() for key, t in l.second_order.items()}
                for l in self.layers
                if self._ready[l.name] and l.second_order
            }
        return state

    def _mismatch(self, entry: str, problem: str) -> ValueError:
        return ValueError(
            f"K-FAC state_dict does not match the model: {entry} {problem} (a "
            "checkpoint of another model, or of K-FAC registering other layers?)"
        )

    def _check_tensor(self, entry: str, value: Any, shape: tuple) -> None:
        if not isinstance(value, torch.Tensor):
            kind = type(value).__name__
            raise self._mismatch(entry, f"is a {kind}, expected a tensor of {shape}")
        if tuple(value.shape) != shape:
            raise self._mismatch(
                entry, f"has shape {tuple(value.shape)}, expected {shape}"
            )
        if not value.is_floating_point():
            raise self._mismatch(entry, f"has dtype {value.dtype}, expected a float")

    def _saved_second_order(self, state_dict: Mapping[str, Any]) -> bool:
        """Checks the saved second-order data; True if it holds everything this
        rank's column needs (the same answer on every rank of a column)."""
        ready, saved = state_dict.get("ready"), state_dict.get("second_order")
        if ready is None or saved is None:
            return False
        names = {l.name for l in self.layers}
        if not isinstance(ready, list | tuple) or not set(ready) <= names:
            raise self._mismatch("'ready'", f"is {ready!r}, expected layer names")
        for name in ready:
            factors = state_dict["layers"][name]
            if factors["A"] is None or factors["G"] is None:
                raise self._mismatch(f"ready layer {name!r}", "has no factors")
        if not isinstance(saved, Mapping) or not set(saved) <= set(ready):
            raise self._mismatch(
                "'second_order'", "is not a dict from ready layers' names to tensors"
            )
        complete = True
        my_column = self.grid.column_of(self.communicator.rank)
        for layer in self.layers:
            held = saved.get(layer.name)
            layout = {key: shape for key, _, shape in self._second_order_layout(layer)}
            if held is None:
                mine = self.assignment[layer.name].column == my_column
                complete &= not (mine and layer.name in ready)
                continue
            if not isinstance(held, Mapping) or set(held) != set(layout):
                # Another compute method (or its prediv option): recompute.
                complete = False
                continue
            for key, shape in layout.items():
                entry = f"second_order[{layer.name!r}][{key!r}]"
                self._check_tensor(entry, held[key], shape)
        return complete

    def _from_kaisa_format(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """A KAISA 0.4 state dict (torch.optim's ``param_groups`` holding the step
        count and the hyperparameters, ``layers`` a list of ``{"A", "G"}`` in
        registration order) as the dict :meth:`state_dict` returns."""
        groups = state_dict["param_groups"]
        if not isinstance(groups, Sequence) or len(groups) != 1:
            raise self._mismatch("'param_groups'", "is not a list of one group")
        group = groups[0]
        converted: dict[str, Any] = {"steps": group.get("step", 0)}
        for name in self._HYPERPARAMETERS:
            if name in group and not callable(group[name]):
                converted[name] = group[name]
        layers = state_dict.get("layers")
        if layers is None:
            return converted
        if isinstance(layers, Mapping):
            converted["layers"] = layers
            return converted
        if not isinstance(layers, Sequence) or len(layers) != len(self.layers):
            count = len(layers) if isinstance(layers, Sequence) else layers
            raise ValueError(
                f"K-FAC state_dict does not match the registered layers: it has "
                f"{count} layers, K-FAC registered {len(self.layers)}"
            )
        converted["layers"] = {}
        for layer, saved in zip(self.layers, layers, strict=True):
            if not isinstance(saved, Mapping):
                raise self._mismatch(f"layer {layer.name!r}", "is not a dict")
            converted["layers"][layer.name] = {
                attr: saved.get(attr, saved.get(f"{attr}_factor")) for attr in "AG"
            }
        return converted

    def load_state_dict(
        self, state_dict: dict[str, Any], compute_inverses: bool = True
    ) -> None:
        """Restores a :meth:`state_dict`.

        The whole dict is checked before anything changes: a dict whose layers
        are not the registered ones, or whose factors or second-order data do not
        have this model's shapes (another model's checkpoint), raises
        ``ValueError`` naming the first mismatching entry, e.g.
        ``layers['fc']['A'] has shape (9, 9), expected (5, 5)``.

        Second-order data (decompositions or inverses):

        * a precond dict whose ``second_order`` holds everything this rank's
          column uses (as saved: same compute method) is loaded as is, and the
          run continues bit-identically to the one that saved it;
        * otherwise (a KAISA-format dict with factors only, another compute
          method, another column's data) it is recomputed from the saved
          factors, unless ``compute_inverses=False``: then no layer is
          preconditioned until the next inverse-update step. Recomputing is
          exact only for a checkpoint taken right before an inverse-update step
          (``steps % inv_update_steps == 0``): at any other step the factors have
          moved on since the decompositions in use were computed.

        A dict without factors (``include_factors=False``) restores ``steps`` and
        the hyperparameters only.
        """
        checked, exact = self._checked_state_dict(state_dict)
        self._steps = int(checked["steps"])
        for name in self._HYPERPARAMETERS:
            if name in checked:
                self.param_groups[0][name] = checked[name]
        layers = checked.get("layers")
        if layers is None:
            if compute_inverses:
                warnings.warn(
                    "K-FAC state_dict has no factors: decompositions are not "
                    "recomputed (they will be at the next inverse-update step)",
                    stacklevel=2,
                )
            return
        self._restore_factors(layers)
        if exact:
            self._restore_second_order(checked["second_order"])
        elif compute_inverses:
            logger.log(
                self.loglevel,
                "K-FAC recomputes the decompositions from the loaded factors",
            )
            self._update_second_order()
        else:
            self._ready = dict.fromkeys(self._ready, False)
            return
        if "ready" in checked:
            # As saved, on every rank (each column may have taken another branch).
            ready = set(checked["ready"])
            self._ready = {l.name: l.name in ready for l in self.layers}

    def _checked_state_dict(self, state_dict: Any) -> tuple[Mapping[str, Any], bool]:
        """``state_dict`` in precond's format (a KAISA one converted), checked
        whole, and whether its second-order data holds everything this rank's
        column uses (then it is loaded as is)."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"Invalid state_dict of type {type(state_dict).__name__}: must be a "
                "dict from KFAC.state_dict()"
            )
        if "param_groups" in state_dict:
            state_dict = self._from_kaisa_format(state_dict)
        check_int("steps", state_dict.get("steps"), low=0)
        checks = dict(_ARGUMENT_CHECKS)
        for name in self._HYPERPARAMETERS:
            if name in state_dict:
                checks[name](name, state_dict[name])
        layers = state_dict.get("layers")
        if layers is None:
            return state_dict, False
        self._check_saved_factors(layers)
        return state_dict, self._saved_second_order(state_dict)

    def _check_saved_factors(self, layers: Any) -> None:
        """Raises at the first saved layer or factor that is not this model's."""
        if not isinstance(layers, Mapping):
            raise self._mismatch("'layers'", "is not a dict by layer name")
        saved, registered = set(layers), {l.name for l in self.layers}
        if saved != registered:
            missing = [l.name for l in self.layers if l.name not in saved]
            unexpected = [name for name in layers if name not in registered]
            raise ValueError(
                "K-FAC state_dict does not match the registered layers: "
                f"missing {missing}, unexpected {unexpected}"
            )
        for layer in self.layers:
            factors = layers[layer.name]
            for attr, dim in (("A", layer.a_dim), ("G", layer.g_dim)):
                entry = f"layers[{layer.name!r}][{attr!r}]"
                if not isinstance(factors, Mapping) or attr not in factors:
                    raise self._mismatch(entry, "is missing")
                if factors[attr] is not None:
                    self._check_tensor(entry, factors[attr], (dim, dim))

    def _restore_factors(self, layers: Mapping[str, Any]) -> None:
        """Copies of the saved factors (folds are in place) in each layer's
        factor dtype and device; contributions and second-order data cleared."""
        for layer in self.layers:
            for attr in ("A", "G"):
                saved_factor = layers[layer.name][attr]
                if saved_factor is not None:
                    saved_factor = saved_factor.to(
                        dtype=self._dtype(layer),
                        device=layer.module.weight.device,
                        copy=True,
                    )
                setattr(layer, attr, saved_factor)
            layer.clear_contributions()
            layer.second_order.clear()

    def _restore_second_order(self, saved: Mapping[str, Any]) -> None:
        """The saved second-order data of this rank's column's layers."""
        my_column = self.grid.column_of(self.communicator.rank)
        for layer in self.layers:
            if self.assignment[layer.name].column != my_column:
                continue
            for key, tensor in saved.get(layer.name, {}).items():
                layer.second_order[key] = tensor.to(
                    dtype=self.inv_dtype,
                    device=layer.module.weight.device,
                    copy=True,
                )
