"""Lifecycle (managed) base of the TokenSpeed nodes, after the ROS 2 managed-node design
(design.ros2.org/articles/node_lifecycle.html).

- configure: read the parameters, create the topics and timers, compile the tools and load the
  model (it waits for the engine); a bad parameter, tool file or model path fails the transition
  cleanly: the node stays unconfigured, logs the reason and keeps it in `configure_error`.
- activate: decisions start. deactivate: the safe fallback goes out and decisions stop.
- cleanup: the engine is freed and every topic, timer and guard condition that configure made
  is destroyed, so the next configure starts from the parameters as they are then.

Parameters: while the node is unconfigured any valid value is taken (it applies at the next
configure); once configured, the table's LIVE parameters apply at once (the subclass's
`apply_live`) and every other change is refused with a reason; bad values are always refused.
With `autostart` (default) the node configures and activates itself once its executor spins (a
one-shot timer, not the constructor), as a plain node. While configure waits for the model (on
the executor), the node still answers the lifecycle queries (`get_state` says "configuring":
`answer_lifecycle_queries`); a transition requested meanwhile waits until configure ends. a failed start-up configure then raises
ConfigureError out of the executor (the entry point ends the process with status 2). The launch
files pass their `autostart` launch argument; `tokenspeed_launch` starts the node with autostart
false and drives the transitions (or leaves them to a lifecycle manager with `--autostart false`).

`EngineNode` is the one set-up of a node that decides with the engine (the agent, the market
bridge): its deadline monitor, engine thread and the decision loop between them, their cleanup,
and the live parameters they share.
"""
from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from typing import ClassVar

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rcl_interfaces.msg import SetParametersResult
from rclpy.duration import Duration
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

from tokenspeed.stages import LoadStages, process_age_s
from tokenspeed_ros.deadline_monitor import DeadlineMonitor
from tokenspeed_ros.decision_loop import DecisionLoop
from tokenspeed_ros.engine_worker import EngineWorker
from tokenspeed_ros.params import AgentParamsError, NodeParams

KINDS = ("publishers", "subscriptions", "timers", "guards", "clients", "services")
# /diagnostics as a latched topic: a listener that joins late (or before DDS discovery has matched it,
# which on localhost can take seconds) gets the latest status at once. Transient-local offered is
# compatible with the volatile, reliable subscriptions of diagnostic_aggregator and rqt.
DIAGNOSTICS_QOS = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
QUERY_POLL_S = 0.05     # while configure waits, lifecycle queries are answered within this (s)


class ConfigureError(RuntimeError):
    """configure cannot complete (e.g. the model does not load); the message says why."""


class ManagedNode(LifecycleNode):
    """Base of the agent and the market bridge. Subclasses set PARAMS (their NodeParams table)
    and CONFIGURE_ERRORS (exceptions that fail configure cleanly, besides AgentParamsError and
    ConfigureError) and implement `configure`, `activate`, `deactivate`, `cleanup` and
    `apply_live`. `self.p` holds the validated parameters; `active` is True between activate and
    deactivate. Raises AgentParamsError at construction on bad parameters, and with autostart
    ConfigureError from the executor's first step when the start-up configure fails (a plain
    node's start-up error: the entry point exits 2)."""

    PARAMS: ClassVar[type[NodeParams]]
    CONFIGURE_ERRORS: ClassVar[tuple[type[Exception], ...]] = ()

    def __init__(self, name: str, **node_kwargs):
        super().__init__(name, **node_kwargs)
        self.p = self.PARAMS.declare(self)
        # start-up stages until the next configure starts the engine (`run_engine_node` sets them
        # from process start; a later configure begins new ones)
        self.startup: LoadStages | None = None
        self.active = False
        self.configured = False
        self.configure_error = ""
        self._baseline = {kind: set(getattr(self, kind)) for kind in KINDS}
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self._autostart_timer = self.create_timer(0.0, self._autostart) if self.p.autostart else None

    def _autostart(self) -> None:
        """One-shot timer of autostart: configure, then activate. Raises ConfigureError."""
        self.destroy_timer(self._autostart_timer)
        self._autostart_timer = None
        try:
            configured = self.trigger_configure() == TransitionCallbackReturn.SUCCESS
        except KeyboardInterrupt:   # Ctrl-C while the model loads: one line, the entry point ends cleanly
            print(f"{self.get_name()}: interrupted during start-up", file=sys.stderr, flush=True)
            raise
        if not configured and not self.context.ok():   # SIGINT / SIGTERM shut the context down mid-configure
            print(f"{self.get_name()}: interrupted during start-up", file=sys.stderr, flush=True)
            return
        if not configured:
            raise ConfigureError(f"configure failed: {self.configure_error}")
        self.trigger_activate()

    def answer_lifecycle_queries(self, done: Callable[[float], bool]) -> None:
        """Wait on the executor thread until `done(timeout_s)` (which itself waits up to timeout_s
        seconds) is True, answering the read-only lifecycle services (get_state,
        get_available_states, get_available_transitions, get_transition_graph) every QUERY_POLL_S
        meanwhile: a lifecycle manager sees "configuring" during a model load instead of a service
        that does not answer. Other callbacks (a change_state request included) wait."""
        queries = (self._service_get_state, self._service_get_available_states,
                   self._service_get_available_transitions, self._service_get_transition_graph)
        while not done(QUERY_POLL_S):
            for srv in queries:
                with srv.handle:
                    request, header = srv.handle.service_take_request(srv.srv_type.Request)
                if header is not None:
                    srv.send_response(srv.callback(request, srv.srv_type.Response()), header)

    # ------------------------------------------------------------------ subclass hooks
    def configure(self) -> None:
        """Create topics, timers and the engine from `self.p`; raise on failure."""
        raise NotImplementedError

    def activate(self) -> None:
        """Start deciding (called after `active` is set)."""

    def deactivate(self) -> None:
        """Publish the safe fallback and stop deciding (called after `active` is cleared)."""

    def cleanup(self, timeout_s: float = 1.0) -> bool:
        """Stop the threads and free the engine and sockets that configure started, waiting up to
        `timeout_s` seconds for the engine; False when its thread is still inside a load or
        forward (see EngineWorker.close). The base destroys topics, timers and guard conditions
        afterwards. Also called after a failed configure and more than once: it must work on a
        partly configured or already clean node."""
        return True

    def apply_live(self, new: NodeParams, changed: set[str]) -> None:
        """Apply LIVE parameters `changed` (new values in `new`) to the running node; raise
        AgentParamsError to refuse them. `self.p` still holds the old values."""

    # ------------------------------------------------------------------ transitions
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        if self.startup is None:
            self.startup = LoadStages()
        else:
            self.startup.done("waiting for configure")
        try:
            self.p = self.PARAMS.read(self)
            self.configure()
        except (AgentParamsError, ConfigureError, *self.CONFIGURE_ERRORS) as e:
            self.configure_error = str(e)
            self.get_logger().error(f"configure failed: {e}")
            self._release()
            gc.enable()
            return TransitionCallbackReturn.FAILURE
        self.configured, self.configure_error = True, ""
        # What configure made (the model, the libraries) lives until cleanup: frozen, it is out of the
        # cyclic collector's sight, so a full collection no longer walks it holding the GIL in the
        # middle of a decision (as in `tokenspeed serve`: ~110 ms of CPU per full collection there).
        # Not collected first: that full collection (0.1-0.17 s of CPU) would delay the engine's
        # "ready"; what it would free (~8,400 objects, ~1 MB, after a start-up without collections:
        # `run_engine_node`) stays frozen. The collector runs again from here (`run_engine_node`
        # turned it off for the start-up).
        gc.freeze()
        gc.enable()
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.active = True
        self.activate()
        self.get_logger().info("active: deciding")
        return super().on_activate(state)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.active = False
        self.deactivate()
        self.get_logger().info("inactive: safe fallback published, not deciding")
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._release()
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        if self.active:
            self.active = False
            self.deactivate()
        self._release()
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.active = False
        self._release()
        return TransitionCallbackReturn.SUCCESS

    def _release(self) -> None:
        """Free the engine and destroy what configure created (idempotent)."""
        gc.unfreeze()  # what configure froze can be collected again once released
        self.cleanup()
        self.configured = False
        for kind in KINDS:
            for entity in set(getattr(self, kind)) - self._baseline[kind]:
                getattr(self, "destroy_" + kind.removesuffix("s").replace("guard", "guard_condition"))(entity)

    def close(self, timeout_s: float = 1.0) -> bool:
        """Shut down from any state (deactivate and clean up); returns False when the engine
        thread is still inside a load or forward (see EngineWorker.close). After Ctrl-C the
        context is already shut down: nothing can be published then, so deactivate is skipped (also
        when the context goes down while deactivate publishes)."""
        if self.active:
            self.active = False
            if self.context.ok():
                try:
                    self.deactivate()
                except Exception:  # noqa: BLE001 - rcl refuses to publish once Ctrl-C shut the context
                    if self.context.ok():
                        raise
        return self.cleanup(timeout_s)

    # ------------------------------------------------------------------ parameters
    def _on_set_parameters(self, params) -> SetParametersResult:
        fields = self.PARAMS.model_fields
        changes = {p.name: p.value for p in params if p.name in fields}
        if not changes:
            return SetParametersResult(successful=True)
        try:
            new = self.PARAMS.validated({**self.p.model_dump(), **changes})
            if self.configured:
                fixed = sorted(set(changes) - self.PARAMS.LIVE)
                if fixed:
                    raise AgentParamsError(
                        f"{', '.join(fixed)}: read at configure; deactivate and clean up {self.PARAMS.NODE}, "
                        f"set it, then configure again (live parameters: {', '.join(sorted(self.PARAMS.LIVE))})")
                self.apply_live(new, set(changes))
        except AgentParamsError as e:
            return SetParametersResult(successful=False, reason=str(e))
        self.p = new
        return SetParametersResult(successful=True)


class EngineNode(ManagedNode):
    """Base of a managed node that decides with the engine (the agent, the market bridge).

    The subclass's `configure` makes `self.monitor` (its DeadlineMonitor) and then calls
    `start_engine`, which makes `self.worker` (the EngineWorker, from the NodeParams engine
    fields) and `self.loop` (the DecisionLoop between them) and waits for the model. `cleanup`
    stops the monitor and the engine thread; `apply_live` applies the live parameters both nodes
    have (deadline_budget_s, publish_margin_s, threads), and `replace_timer` remakes a periodic
    timer whose period is live. A subclass extends `cleanup` and `apply_live` and calls them.
    """

    def __init__(self, name: str, **node_kwargs):
        self.worker: EngineWorker | None = None     # from configure to cleanup (None: no agent)
        self.monitor: DeadlineMonitor | None = None  # made at configure, closed at cleanup
        self.loop: DecisionLoop | None = None
        super().__init__(name, **node_kwargs)

    def start_engine(self, tools: list[dict] | None, *, on_observed=None, on_decided_ahead=None, check_result=None,
                     on_resolved=None, **worker_options) -> None:
        """Make the engine thread for `tools` (an OpenAI tool list; None = no agent: every
        decision falls back "no_agent"; a call is required unless a decision says otherwise) with
        `worker_options` (EngineWorker's repeat_slack, replace_sources), and the DecisionLoop
        between it and `self.monitor` (the callbacks: see DecisionLoop); then load the model and
        wait for it, answering the lifecycle queries (`answer_lifecycle_queries`). Raises
        ConfigureError when the model did not load."""
        p = self.p
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", DIAGNOSTICS_QOS)
        stages, self.startup = self.startup or LoadStages(), None
        stages.done("configure: parameters, topics, tools")
        if tools is not None:
            wake = self.create_guard_condition(lambda: self.loop.on_engine_output())
            self.worker = EngineWorker(model=p.model, threads=p.threads, quantize=p.quantize, device=p.device,
                                       dtype=p.dtype, system=p.system_prompt, tools=tools, tool_choice="required",
                                       kv_budget=p.kv_budget_tokens, notify=wake.trigger, logger=self.get_logger(),
                                       stages=stages, **worker_options)
        self.loop = DecisionLoop(self.monitor, self.worker, self.get_clock(), publish_margin_s=p.publish_margin_s,
                                 on_observed=on_observed, on_decided_ahead=on_decided_ahead, check_result=check_result,
                                 on_resolved=on_resolved)
        if self.worker is not None:
            self.worker.start()
            self.answer_lifecycle_queries(lambda timeout_s: self.worker.wait_loaded(timeout_s) != "loading")
            if self.worker.state != "ready":
                raise ConfigureError(f"the model did not load: {self.worker.fault}")

    def startup_values(self) -> list[KeyValue]:
        """/diagnostics values of the engine's start-up once it is ready (else none): "startup:
        <stage>" = "<wall s> <CPU s>" for each stage from process start to the engine ready
        (`EngineWorker.stages`), "startup: process started" = when this process started and
        "ready at" = when the engine became ready (both seconds since the epoch), so a listener
        can place them on its own clock, however late it hears them."""
        w = self.worker
        if w is None or w.state != "ready":
            return []
        return ([KeyValue(key="ready at", value=f"{w.ready_at:.3f}"),
                 KeyValue(key="startup: process started", value=f"{time.time() - process_age_s():.3f}")]
                + [KeyValue(key=f"startup: {name}", value=f"{wall:.3f} {cpu:.3f}")
                   for name, (wall, cpu) in w.stages.items()])

    def publish_diagnostics(self, *statuses: DiagnosticStatus) -> None:
        """Publish on /diagnostics the deadline monitor's "<fully qualified node name>: decisions"
        status and `statuses`, each with that name as hardware_id (two nodes are told apart)."""
        fqn = self.get_fully_qualified_name()
        msg = DiagnosticArray(status=[self.monitor.diagnostic_status(f"{fqn}: decisions"), *statuses])
        for status in msg.status:
            status.hardware_id = fqn
        msg.header.stamp = self.get_clock().now().to_msg()
        self._diag_pub.publish(msg)

    def cleanup(self, timeout_s: float = 1.0) -> bool:
        """Stop the deadline monitor's thread and the engine thread (see ManagedNode.cleanup)."""
        if self.monitor is not None:
            self.monitor.close()
        worker, self.worker = self.worker, None
        return worker.close(timeout_s) if worker is not None else True

    def apply_live(self, new: NodeParams, changed: set[str]) -> None:
        """Apply the live parameters every engine node has: deadline_budget_s, publish_margin_s,
        threads (see ManagedNode.apply_live)."""
        if "deadline_budget_s" in changed:
            self.monitor.budget = Duration(seconds=new.deadline_budget_s)
        self.loop.publish_margin_s = new.publish_margin_s
        if "threads" in changed and self.worker is not None:
            self.worker.set_threads(new.threads)

    def replace_timer(self, timer, period_s: float, callback):
        """Destroy `timer` (or None) and return a new one of `period_s` seconds calling
        `callback`, or None when period_s <= 0 (off)."""
        if timer is not None:
            self.destroy_timer(timer)
        return self.create_timer(period_s, callback) if period_s > 0 else None
