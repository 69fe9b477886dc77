//! What every Sluice binary shares: Kafka client settings, logging, the metrics endpoint and
//! shutdown signals. Each module does one of these jobs.

pub mod kafka;
pub mod metrics;
pub mod shutdown;
pub mod telemetry;
