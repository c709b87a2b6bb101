"""KV events of one daemon: the engine's listener, the publisher thread and snapshots, started
and stopped together (``kvtierd --kv-events-endpoint``)."""
from __future__ import annotations

from .event_sink import KVEventSink
from .publisher import KVEventPublisher, PublisherStatistics
from .snapshot import KVSnapshot, take_snapshot


class KVEvents:
    def __init__(self, engine, endpoint: str, replay_endpoint: str | None = None, topic: str = ""):
        self._engine = engine
        self.sink = KVEventSink()
        try:
            self.publisher = KVEventPublisher(self.sink, endpoint, replay_endpoint, topic)
        except BaseException:
            self.sink.close()
            raise
        self.publisher.start()
        engine.set_block_listener(self.sink)

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint

    def snapshot(self) -> KVSnapshot:
        return take_snapshot(self._engine, self.sink)

    def statistics(self) -> PublisherStatistics:
        return self.publisher.statistics()

    def stop(self) -> None:
        """Stop listening, send what is queued, close the sockets."""
        from kvtier.daemon.engine.block_events import NO_LISTENER
        self._engine.set_block_listener(NO_LISTENER)
        self.publisher.stop()
        self.sink.close()
