//! What every Sluice binary shares: Kafka client settings, logging, the metrics endpoint, the
//! HTTP error shape, shutdown signals and W3C trace context. Each module does one of these jobs.

pub mod http_error;
pub mod kafka;
pub mod metrics;
pub mod shutdown;
pub mod telemetry;
pub mod trace;
