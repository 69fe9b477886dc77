//! What every Sluice binary shares: Kafka client settings and the one policy for its errors, backpressure on a consumer, ordered
//! acknowledgement of a partition's records, logging, the metrics endpoint, the
//! HTTP client and error shape, object stores by URL, shutdown signals, W3C trace context and its OTLP export. Each module does one of these jobs.

pub mod backpressure;
pub mod http_client;
pub mod http_error;
pub mod kafka;
pub mod kafka_failure;
pub mod metrics;
pub mod object_url;
pub mod ordered_acks;
pub mod otlp;
pub mod shutdown;
pub mod telemetry;
pub mod trace;
pub mod transaction_producer;
