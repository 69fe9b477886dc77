//! What every Sluice binary shares: Kafka client settings, logging, the metrics endpoint, the
//! HTTP error shape and shutdown signals. Each module does one of these jobs.

pub mod http_error;
pub mod kafka;
pub mod metrics;
pub mod shutdown;
pub mod telemetry;
