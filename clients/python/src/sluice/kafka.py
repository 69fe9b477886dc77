"""The completion topic, read `read_committed`: typed completion and DLQ records, each committed
after the caller's handler returns. Needs the `kafka` extra (`pip install 'sluice-client[kafka]'`).

    from sluice.kafka import completions
    with completions("localhost:9092", "billing") as records:
        for record in records:           # the previous record is committed here
            if record.completion:
                charge(record.completion["tenant"], record.completion["task_id"])

In exactly-once mode (the workers' default) each finished attempt is on the topic once, so with
`read_committed` a handler sees each of them once, unless it fails before its record is
committed: then that record is delivered again (commit after handling: at least once to the
handler, never lost).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, cast

from .errors import RecordDecodeError, SluiceError
from .types import CompletionEvent, DlqRecord

COMPLETIONS_TOPIC = "sluice.completions.v1"
DLQ_TOPIC = "sluice.dlq.v1"


@dataclass(frozen=True)
class Record:
    """A decoded record: `completion` on the completion topic, `dlq` on the dead-letter topic."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    key: str | None
    kind: Literal["completion", "dlq"]
    completion: CompletionEvent | None
    dlq: DlqRecord | None

    @property
    def task_id(self) -> str | None:
        if self.completion is not None:
            return self.completion["task_id"]
        return self.dlq.get("task_id") if self.dlq is not None else None


def decode(topic: str, partition: int, offset: int, timestamp_ms: int | None, key: bytes | None, value: bytes | None, dlq_topic: str) -> Record:
    """A record of the completion topic or of `dlq_topic`, checked to be version 1."""
    where = f"{topic}/{partition}@{offset}"

    def refused(why: str) -> RecordDecodeError:
        return RecordDecodeError(f"{where}: {why}", topic, partition, offset, value)

    try:
        body: Any = json.loads(value or b"")
    except ValueError as e:
        raise refused("not JSON") from e
    if not isinstance(body, dict) or body.get("version") != 1:
        raise refused("not a version 1 record")
    is_dlq = topic == dlq_topic
    required = ("reason", "original") if is_dlq else ("task_id", "status", "outputs")
    if any(k not in body for k in required):
        raise refused(f"missing {', '.join(k for k in required if k not in body)}")
    return Record(
        topic,
        partition,
        offset,
        timestamp_ms,
        key.decode("utf-8", "replace") if key is not None else None,
        "dlq" if is_dlq else "completion",
        None if is_dlq else cast(CompletionEvent, body),
        cast(DlqRecord, body) if is_dlq else None,
    )


class Completions:
    """A consumer of the completion topic (and the DLQ topic, unless `dlq_topic=None`) in group
    `group`, `read_committed`, committing each record after it was handled.

    `from_time` (timezone-aware) is where to start in partitions the group has not committed
    yet: the first record at or after that time, instead of the topic's beginning. To replay a
    range again, use a new group name. `config` adds or overrides librdkafka settings
    (security, for instance).
    """

    def __init__(
        self,
        brokers: str,
        group: str,
        *,
        topic: str = COMPLETIONS_TOPIC,
        dlq_topic: str | None = DLQ_TOPIC,
        from_time: datetime | None = None,
        config: Mapping[str, Any] | None = None,
        poll_timeout: float = 1.0,
    ) -> None:
        try:
            from confluent_kafka import Consumer
        except ImportError as e:  # pragma: no cover - depends on the install
            raise SluiceError("sluice.kafka needs the kafka extra: pip install 'sluice-client[kafka]'") from e
        settings: dict[str, Any] = {
            "bootstrap.servers": brokers,
            "group.id": group,
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
        }
        settings.update(config or {})
        if from_time is not None and from_time.tzinfo is None:
            raise ValueError("from_time must be timezone-aware (datetime.now(timezone.utc), for instance)")
        self._cooperative = "cooperative" in str(settings.get("partition.assignment.strategy", ""))
        self._consumer = Consumer(settings)
        self._dlq_topic = dlq_topic or ""
        self._poll_timeout = poll_timeout
        self._from_ms = None if from_time is None else int(from_time.timestamp() * 1000)
        self._closed = False
        self._failed: SluiceError | None = None
        topics = [topic] + ([dlq_topic] if dlq_topic else [])
        self._consumer.subscribe(topics, on_assign=self._on_assign)

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        if self._from_ms is None or not partitions:
            return
        try:
            self._start_at_time(consumer, partitions, self._from_ms)
        except Exception as e:
            # Nothing assigned: left to itself, confluent-kafka would assign the partitions from
            # the group's commits or their beginning, not from `from_time`.
            self._failed = SluiceError(f"finding where to start at from_time: {e}")
            partitions = []
        if self._cooperative:
            consumer.incremental_assign(partitions)
        else:
            consumer.assign(partitions)

    def _start_at_time(self, consumer: Any, partitions: list[Any], from_ms: int) -> None:
        """Sets where each partition the group has not committed starts: its first record at or
        after `from_ms`, or, where there is none, its end as it was before the lookup. Not the
        end at assignment (`OFFSET_END`): that is resolved later, when fetching starts, and a
        record appended in between would be skipped. `read_committed`, the end is the last
        stable offset, so a transaction still open is read once it commits."""
        from confluent_kafka import TopicPartition

        committed = consumer.committed(partitions, timeout=30)
        fresh = [tp for tp in committed if tp.offset < 0]  # nothing committed by the group
        if not fresh:
            return
        # Timestamp -1 asks for the end; `read_committed`, the broker answers the last stable offset.
        ends = {(tp.topic, tp.partition): tp for tp in consumer.offsets_for_times([TopicPartition(tp.topic, tp.partition, -1) for tp in fresh], timeout=30)}
        found = consumer.offsets_for_times([TopicPartition(tp.topic, tp.partition, from_ms) for tp in fresh], timeout=30)
        positions = {(tp.topic, tp.partition): tp for tp in found}
        for tp in partitions:
            at = positions.get((tp.topic, tp.partition))
            if at is None:
                continue
            end = ends[(tp.topic, tp.partition)]
            for error in (at.error, end.error):
                if error is not None:
                    raise SluiceError(f"finding {tp.topic}/{tp.partition} at the replay time: {error}")
            # Nothing at or after that time: from the end found before the lookup.
            tp.offset = at.offset if at.offset >= 0 else end.offset

    def __enter__(self) -> Completions:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _rewind(self, topic: str, partition: int, offset: int) -> None:
        """Reads from `offset` again: a record not handled is delivered again. Best effort: a
        partition taken away meanwhile is read from its commit by its next owner anyway."""
        from confluent_kafka import KafkaException, TopicPartition

        try:
            self._consumer.seek(TopicPartition(topic, partition, offset))
        except KafkaException:
            pass

    def poll(self, timeout: float | None = None) -> tuple[Record, Any] | None:
        """The next record and its raw message (pass it to `commit`), or `None` after `timeout`.
        A record that does not decode raises `RecordDecodeError`, the consumer left before it
        (`skip` commits past it). After a failure to find where `from_time` starts, every call
        raises it: the reader was assigned nothing."""
        if self._failed is not None:
            raise self._failed
        message = self._consumer.poll(self._poll_timeout if timeout is None else timeout)
        if message is None:
            return None
        error = message.error()
        if error is not None:
            if error.fatal():
                raise SluiceError(f"consuming the completion topic: {error}")
            return None  # librdkafka recovers from the others itself
        _, stamp = message.timestamp()
        try:
            record = decode(
                message.topic() or "",
                message.partition() or 0,
                message.offset() or 0,
                stamp if stamp >= 0 else None,
                message.key(),
                message.value(),
                self._dlq_topic,
            )
        except RecordDecodeError:
            self._rewind(message.topic() or "", message.partition() or 0, message.offset() or 0)
            raise
        return record, message

    def commit(self, message: Any) -> None:
        """Commits a record returned by `poll` (the position after it)."""
        from confluent_kafka import TopicPartition

        self._consumer.commit(
            offsets=[TopicPartition(message.topic(), message.partition(), message.offset() + 1)], asynchronous=False
        )

    def skip(self, error: RecordDecodeError) -> None:
        """Commits past a record that did not decode, and reads on after it."""
        from confluent_kafka import TopicPartition

        after = TopicPartition(error.topic, error.partition, error.offset + 1)
        self._consumer.commit(offsets=[after], asynchronous=False)
        self._consumer.seek(after)

    def __iter__(self) -> Iterator[Record]:
        """Records as they come. Each is committed when the next one is asked for; one whose
        handling raised, or after which the loop was left, is read again (here or by the group's
        next reader)."""
        while not self._closed:
            polled = self.poll()
            if polled is None:
                continue
            record, message = polled
            try:
                yield record
            except GeneratorExit:
                if not self._closed:
                    self._rewind(record.topic, record.partition, record.offset)
                raise
            self.commit(message)

    def run(
        self,
        handler: Callable[[Record], None],
        *,
        stop: threading.Event | None = None,
        max_records: int | None = None,
        idle_timeout: float | None = None,
    ) -> int:
        """Calls `handler` for each record and commits it once `handler` returned. Stops when
        `stop` is set, after `max_records`, or after `idle_timeout` seconds without a record;
        returns how many were handled. An exception from `handler` propagates, its record not
        committed and read again."""
        import time

        handled = 0
        idle_since = time.monotonic()
        while not (stop is not None and stop.is_set()) and (max_records is None or handled < max_records):
            polled = self.poll()
            if polled is None:
                if idle_timeout is not None and time.monotonic() - idle_since > idle_timeout:
                    break
                continue
            record, message = polled
            try:
                handler(record)
            except BaseException:
                self._rewind(record.topic, record.partition, record.offset)
                raise
            self.commit(message)
            handled += 1
            idle_since = time.monotonic()
        return handled

    def close(self) -> None:
        """Leaves the group. A record yielded by the iterator and not yet committed stays
        uncommitted (the group's next reader gets it)."""
        if not self._closed:
            self._closed = True
            self._consumer.close()


def completions(brokers: str, group: str, **options: Any) -> Completions:
    """A `Completions` consumer; see its options."""
    return Completions(brokers, group, **options)
