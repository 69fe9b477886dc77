//! One policy for Kafka client errors: what a failure means for the code that met it. Every
//! place that judges a librdkafka error (the worker's poll loop, its committer, its outcome
//! publisher, the producer's publish) asks [`classify`], and keeps the error itself as its
//! `source`.
//!
//! Only librdkafka's own verdict makes a failure [`Failure::Fatal`] or [`Failure::Fenced`]: a
//! consumer error it reports as fatal, a transactional error it marks fatal, or its `Fatal` code.
//! A fencing code in an error librdkafka did not call fatal (a consumer rejoining after a stale
//! member epoch) is something it recovers from by itself, so it is [`Failure::Retriable`].

use std::fmt;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// What a Kafka error means for the code that met it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The same request may succeed later: the broker away or busy, a timeout, a leader or a
    /// coordinator moving, a transaction still being completed. Retry, within the caller's bound.
    Retriable,
    /// The client's own send queue is full: serve its events, then send again.
    QueueFull,
    /// The open transaction cannot commit: abort it, then do its work again in a new one.
    Abortable,
    /// Another instance took this one's place (a producer with the same transactional id, a
    /// group member with the same instance id): stop; retrying would fight the newer instance.
    Fenced,
    /// The client cannot go on: stop; a restarted process makes a new one.
    Fatal,
    /// The request itself is refused (too large, not authorized, an unknown topic, a bad
    /// argument or configuration): the same request will fail again.
    Permanent,
}

impl Failure {
    /// The client that met it is done for: the process should stop and be restarted.
    pub fn ends_client(self) -> bool {
        matches!(self, Failure::Fatal | Failure::Fenced)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Failure::Retriable => "retriable",
            Failure::QueueFull => "queue_full",
            Failure::Abortable => "abortable",
            Failure::Fenced => "fenced",
            Failure::Fatal => "fatal",
            Failure::Permanent => "permanent",
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What `error` means; see [`Failure`].
pub fn classify(error: &KafkaError) -> Failure {
    match error {
        KafkaError::MessageConsumptionFatal(code) => fatal(*code),
        KafkaError::Transaction(e) => transactional(e.is_fatal(), e.txn_requires_abort(), e.is_retriable(), e.code()),
        KafkaError::ClientConfig(..) | KafkaError::ClientCreation(_) | KafkaError::Nul(_) => Failure::Permanent,
        other => other.rdkafka_error_code().map_or(Failure::Retriable, by_code),
    }
}

/// A transactional error, from the flags librdkafka sets on it (checked in this order) and its
/// code. One with no flag set is [`Failure::Permanent`]: librdkafka would retry it itself if it
/// could, and the transaction can be neither retried nor aborted because of it.
fn transactional(is_fatal: bool, requires_abort: bool, is_retriable: bool, code: RDKafkaErrorCode) -> Failure {
    if is_fatal {
        fatal(code)
    } else if requires_abort {
        Failure::Abortable
    } else if is_retriable {
        Failure::Retriable
    } else {
        Failure::Permanent
    }
}

/// A fatal error: fenced where its code says another instance replaced this one.
fn fatal(code: RDKafkaErrorCode) -> Failure {
    match code {
        RDKafkaErrorCode::Fenced
        | RDKafkaErrorCode::ProducerFenced
        | RDKafkaErrorCode::InvalidProducerEpoch
        | RDKafkaErrorCode::TransactionCoordinatorFenced
        | RDKafkaErrorCode::FencedInstanceId => Failure::Fenced,
        _ => Failure::Fatal,
    }
}

/// An error librdkafka did not call fatal, by its code.
fn by_code(code: RDKafkaErrorCode) -> Failure {
    use RDKafkaErrorCode as C;
    match code {
        C::Fatal => Failure::Fatal,
        C::QueueFull => Failure::QueueFull,
        C::MessageSizeTooLarge
        | C::InvalidArgument
        | C::UnknownTopic
        | C::InvalidRecord
        | C::UnsupportedVersion
        | C::InvalidTransactionTimeout
        | C::Authentication
        | C::SaslAuthenticationFailed
        | C::TopicAuthorizationFailed
        | C::GroupAuthorizationFailed
        | C::ClusterAuthorizationFailed
        | C::TransactionalIdAuthorizationFailed => Failure::Permanent,
        _ => Failure::Retriable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::error::RDKafkaErrorCode as C;

    #[test]
    fn the_broker_away_or_busy_is_retried() {
        for code in [
            C::BrokerTransportFailure,
            C::AllBrokersDown,
            C::MessageTimedOut,
            C::OperationTimedOut,
            C::RequestTimedOut,
            C::NetworkException,
            C::LeaderNotAvailable,
            C::NotLeaderForPartition,
            C::NotEnoughReplicas,
            C::CoordinatorLoadInProgress,
            C::CoordinatorNotAvailable,
            C::NotCoordinator,
            C::ConcurrentTransactions,
            C::UnknownTopicOrPartition,
        ] {
            assert_eq!(classify(&KafkaError::MessageProduction(code)), Failure::Retriable, "{code:?}");
            assert_eq!(classify(&KafkaError::ConsumerCommit(code)), Failure::Retriable, "{code:?}");
        }
        assert_eq!(classify(&KafkaError::Canceled), Failure::Retriable);
    }

    #[test]
    fn a_full_send_queue_is_its_own_case() {
        assert_eq!(classify(&KafkaError::MessageProduction(C::QueueFull)), Failure::QueueFull);
        assert!(!Failure::QueueFull.ends_client());
    }

    #[test]
    fn a_refused_request_is_not_retried() {
        for code in [
            C::MessageSizeTooLarge,
            C::InvalidArgument,
            C::UnknownTopic,
            C::TopicAuthorizationFailed,
            C::TransactionalIdAuthorizationFailed,
            C::SaslAuthenticationFailed,
        ] {
            assert_eq!(classify(&KafkaError::MessageProduction(code)), Failure::Permanent, "{code:?}");
        }
        assert_eq!(classify(&KafkaError::ClientCreation("no".into())), Failure::Permanent);
    }

    #[test]
    fn only_librdkafkas_fatal_verdict_ends_a_client() {
        // A consumer error librdkafka reports as fatal: fenced by a newer static member, or
        // unusable for another reason (KIP-848's UNRELEASED_INSTANCE_ID).
        assert_eq!(classify(&KafkaError::MessageConsumptionFatal(C::FencedInstanceId)), Failure::Fenced);
        assert_eq!(
            classify(&KafkaError::MessageConsumptionFatal(C::UnreleasedInstanceId)),
            Failure::Fatal
        );
        assert_eq!(classify(&KafkaError::Global(C::Fatal)), Failure::Fatal);
        // The same codes in an error it recovers from itself (a rejoin) are no reason to stop.
        for code in [
            C::FencedInstanceId,
            C::FencedMemberEpoch,
            C::StaleMemberEpoch,
            C::UnreleasedInstanceId,
        ] {
            let failure = classify(&KafkaError::MessageConsumption(code));
            assert!(!failure.ends_client(), "{code:?}: {failure}");
        }
        assert!(Failure::Fenced.ends_client() && Failure::Fatal.ends_client());
    }

    #[test]
    fn a_transactional_error_follows_its_flags() {
        // (fatal, requires abort, retriable): librdkafka's flags, checked in that order.
        assert_eq!(transactional(true, false, false, C::ProducerFenced), Failure::Fenced);
        assert_eq!(transactional(true, false, false, C::InvalidProducerEpoch), Failure::Fenced);
        assert_eq!(transactional(true, false, false, C::Fenced), Failure::Fenced);
        assert_eq!(transactional(true, true, true, C::OutOfOrderSequenceNumber), Failure::Fatal);
        assert_eq!(transactional(false, true, true, C::MessageTimedOut), Failure::Abortable);
        assert_eq!(transactional(false, false, true, C::ConcurrentTransactions), Failure::Retriable);
        assert_eq!(transactional(false, false, true, C::RequestTimedOut), Failure::Retriable);
        assert_eq!(transactional(false, false, false, C::InvalidTransactionalState), Failure::Permanent);
    }
}
