"""hivemind's private methods and attributes under public names: the bases cotrain's averagers, optimizer,
progress tracker, all-reduce runner and authorizer build on, and the helpers for the private calls cotrain
makes on hivemind's objects.

Each base overrides a private method of its hivemind class with a call to a public hook of the same meaning
(``_run_allreduce_inplace_`` calls ``run_allreduce``), whose default is hivemind's method itself. Code outside
this package overrides and calls the public hooks only; a hivemind method renamed upstream then fails
``install()`` (cotrain.hivemind_ext.manifest) instead of an override that silently stops being called.

The bases sit right before the hivemind class they adapt in a subclass's method order (``class X(Mixins,
GradientAverager, Averager)`` puts ``Averager`` after ``GradientAverager`` and before
``DecentralizedAverager``), so that every hivemind layer above reaches the hooks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import hivemind
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.p2p import P2P
from hivemind.p2p.servicer import ServicerBase
from hivemind.utils import get_dht_time
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey


class Averager(DecentralizedAverager):
    """DecentralizedAverager's private parts, as hooks and properties."""

    # the averager's own state and connections (its serving process or thread)
    @property
    def p2p(self) -> P2P:
        """The P2P this averager's serving loop uses (set once it runs)."""
        return self._p2p

    @property
    def running_groups(self) -> dict:
        """Group id -> the future of the all-reduce runner of each round in progress."""
        return self._running_groups

    @property
    def allreduce_timeout(self) -> float | None:
        return self._allreduce_timeout

    @property
    def averaging_alpha(self) -> float:
        return self._averaging_alpha

    @property
    def group_key_prefix(self) -> str:
        """The DHT key prefix of this averager's matchmaking (its ``all_averagers`` record lies under it)."""
        return self._matchmaking.group_key_manager.prefix

    def mark_updated(self) -> None:
        """The averaged tensors changed: the time, and the event that re-declares this averager's state."""
        self.last_updated = get_dht_time()
        self._state_updated.set()

    def serve_only(self, methods: frozenset[str]) -> None:
        """Register (and at shutdown remove) only these of the averager's ``rpc_*`` handlers (call it before
        the averager starts). Two averagers of one prefix in one peer answer disjoint sets: the monitor's copy
        of the state serves downloads, its auxiliary reducer's state averager the all-reduces (hivemind names
        a handler after the prefix and the method, so both would claim the same names)."""
        ServicerBase._collect_rpc_handlers.__func__(type(self))
        # an instance attribute in front of the class's list, which hivemind's add and remove iterate
        self._rpc_handlers = [h for h in type(self)._rpc_handlers if h.method_name in methods]

    def ask_serving_loop(self, method: str, **kwargs: Any) -> None:
        """Run ``self.<method>(**kwargs)`` (a coroutine method) in the averager's serving loop, as hivemind's
        own requests do (pass a ``future`` to get an answer)."""
        self._outer_pipe.send((method, [], kwargs))

    # hooks: hivemind's methods by default
    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        return await self.run_allreduce(tensors, group_info, group_id, **kwargs)

    async def run_allreduce(self, tensors, group_info, group_id=None, **kwargs):
        """Average ``tensors`` in place with the group (one all-reduce); hivemind's by default."""
        run = DecentralizedAverager._run_allreduce_inplace_
        return await run(self, tensors, group_info, group_id, **kwargs)

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        return await self.aggregate_with_group(group_info, min_vector_size, **kwargs)

    async def aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        """A matched group's round: split the work, run the all-reduce; hivemind's by default."""
        return await DecentralizedAverager._aggregate_with_group(self, group_info, min_vector_size, **kwargs)

    async def _load_state_from_peers(self, future, timeout: float | None = None) -> None:
        return await self.download_state(future, timeout)

    async def download_state(self, future, timeout: float | None = None) -> None:
        """Download the state from another peer into ``future`` (run in the serving loop); hivemind's by
        default."""
        return await DecentralizedAverager._load_state_from_peers(self, future, timeout)

    # the class whose name the libp2p protocol names of this averager's handlers carry (hivemind names them
    # after the class: ``namespace::Class.method``); None: this class's own
    handler_class: type | None = None

    @classmethod
    def _get_handle_name(cls, namespace: str | None, method_name: str) -> str:
        return ServicerBase._get_handle_name.__func__(cls.handler_class or cls, namespace, method_name)


class DHT(hivemind.DHT):
    """The DHT's private request pipes and record validator, wrapped through methods."""

    def wrap_request_pipe(self, wrap: Callable[[Any], Any]) -> None:
        """The sending end of the requests to the DHT's serving process or thread (in every process)."""
        self._outer_pipe = wrap(self._outer_pipe)

    def wrap_served_requests(self, wrap: Callable[[Any], Any]) -> None:
        """The receiving end of those requests (call it in the serving process or thread, from ``run``)."""
        self._inner_pipe = wrap(self._inner_pipe)

    def wrap_record_validator(self, wrap: Callable[[Any], Any]) -> None:
        """The validator of the records this node stores and reads (from ``run``, before it starts)."""
        self._record_validator = wrap(self._record_validator)

    def daemon_listen_maddr(self) -> Any:
        """The address of the p2pd daemon's control socket (for a replica of the DHT's P2P)."""
        return self.run_coroutine(hivemind.DHT._get_p2p_daemon_listen_maddr)


class Optimizer(hivemind.Optimizer):
    """hivemind.Optimizer's private pipeline, as hooks."""

    def _make_progress_tracker(self, target_batch_size: int, **kwargs):
        return self.make_progress_tracker(target_batch_size, **kwargs)

    def make_progress_tracker(self, target_batch_size: int, **kwargs):
        return hivemind.Optimizer._make_progress_tracker(self, target_batch_size, **kwargs)

    def _make_state_averager(self, **kwargs):
        return self.make_state_averager(**kwargs)

    def make_state_averager(self, **kwargs):
        return hivemind.Optimizer._make_state_averager(self, **kwargs)

    def _average_gradients_and_load_into_optimizer(self, maybe_step_control) -> None:
        return self.average_gradients(maybe_step_control)

    def average_gradients(self, maybe_step_control) -> None:
        """Average the accumulated gradients (in ``maybe_step_control``'s round, or a new one) and load them
        into the optimizer; hivemind's by default."""
        return hivemind.Optimizer._average_gradients_and_load_into_optimizer(self, maybe_step_control)

    def _maybe_schedule_gradient_averaging(self) -> None:
        return self.maybe_schedule_gradient_averaging()

    def maybe_schedule_gradient_averaging(self) -> None:
        return hivemind.Optimizer._maybe_schedule_gradient_averaging(self)

    def _update_global_epoch(self, grad_scaler) -> None:
        return self.update_global_epoch(grad_scaler)

    def update_global_epoch(self, grad_scaler) -> None:
        """The swarm reached the target batch: average, step, move to the next global step."""
        return hivemind.Optimizer._update_global_epoch(self, grad_scaler)

    def tag_along_with_zero_weight(self, control) -> None:
        """Let a scheduled round go on with this peer as a weightless member (others' rounds are not left
        short of a member that was expected)."""
        return self._tag_along_with_zero_weight(control)


class Tracker(ProgressTracker):
    """ProgressTracker's private reading of the peers' progress records, and the signal to its reporter, as
    hooks."""

    def signal_reports_with(self, event: threading.Event) -> None:
        """Let ``event`` be the signal that makes the tracker's reporter store this peer's progress record:
        ``report_local_progress`` sets it at every call and the reporter stores a record each time it wakes
        (the reporter reads the attribute again at every wait: call before ``start``)."""
        self.should_report_progress = event

    def _parse_swarm_progress_data(self, metadata):
        return self.parse_swarm_progress(metadata)

    def parse_swarm_progress(self, metadata):
        """The swarm's progress from the peers' records (``metadata``); hivemind's by default."""
        return ProgressTracker._parse_swarm_progress_data(self, metadata)


class Runner(AllReduceRunner):
    """AllReduceRunner's private exchange with one peer, as a hook."""

    async def _communicate_with_peer(self, peer_id) -> None:
        return await self.communicate_with_peer(peer_id)

    async def communicate_with_peer(self, peer_id) -> None:
        """Send this peer's parts for ``peer_id``'s span and receive their averages; hivemind's by default."""
        return await AllReduceRunner._communicate_with_peer(self, peer_id)

    async def ban_sender(self, peer_id) -> None:
        """Stop waiting for ``peer_id``'s parts in this round (its contribution is dropped)."""
        await self._ban_sender(peer_id)


class Authorizer(TokenAuthorizerBase):
    """TokenAuthorizerBase's private key and token, set and refreshed through methods."""

    def set_local_key(self, key: RSAPrivateKey) -> None:
        self._local_private_key, self._local_public_key = key, key.get_public_key()

    async def refresh_token_if_needed(self) -> None:
        """hivemind's, less its assertion that the new token is valid: an expired or revoked token of this
        peer's own is reported by the peer's access watcher (cotrain.net.probe) instead of failing every
        request of this process with an AssertionError."""
        if self._local_access_token is None or self.does_token_need_refreshing(self._local_access_token):
            async with self._refresh_lock:
                self._local_access_token = await self.get_token()


def p2p_client(p2p: P2P) -> Any:
    """The P2P's daemon client (``connect`` to a peer at given addresses)."""
    return p2p._client


def load_local_tensors(averager: Any) -> None:
    """A TrainingStateAverager's optimizer state and parameters were set from outside (a checkpoint, a
    backup): copy them into the averager's own tensors."""
    averager._load_local_tensors_into_averager_()


def apply_optimizer_parameters(averager: Any) -> None:
    """A TrainingStateAverager's averaged parameters into the model's (the offloaded optimizer's copy)."""
    averager._apply_optimizer_parameters_()
