//! Kafka client settings shared by the producer and the worker.

use clap::Args;
use rdkafka::ClientConfig;

/// Connection settings of any Sluice Kafka client.
#[derive(Debug, Clone, Args)]
pub struct KafkaClientArgs {
    /// Kafka bootstrap servers.
    #[arg(long = "kafka-brokers", env = "SLUICE_KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    pub brokers: String,
    /// Extra librdkafka properties, `key=value`, comma-separated (TLS, SASL, tuning). Applied
    /// after Sluice's own settings, so they can override them.
    #[arg(long = "kafka-option", env = "SLUICE_KAFKA_OPTIONS", value_delimiter = ',', value_parser = parse_key_value)]
    pub options: Vec<(String, String)>,
}

/// Largest record Sluice produces (a DLQ record carries the original record, base64-encoded).
pub const MAX_MESSAGE_BYTES: usize = 32 << 20;

impl KafkaClientArgs {
    /// A client configuration with the bootstrap servers and `settings`, then the user's extra
    /// properties on top.
    pub fn config(&self, settings: &[(&str, &str)]) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.brokers);
        for (k, v) in settings {
            config.set(*k, *v);
        }
        for (k, v) in &self.options {
            config.set(k, v);
        }
        config
    }

    /// A producer that never loses or duplicates an acknowledged record: every in-sync replica
    /// acknowledges (`acks=all`), and retries are deduplicated by the broker (idempotence).
    ///
    /// `linger_ms` trades latency for fewer, larger produce requests (a broker's cost is mostly
    /// per request).
    pub fn producer_config(&self, client_id: &str, delivery_timeout_ms: u64, linger_ms: u32) -> ClientConfig {
        let timeout = delivery_timeout_ms.to_string();
        let max_bytes = MAX_MESSAGE_BYTES.to_string();
        let linger = linger_ms.to_string();
        self.config(&[
            ("client.id", client_id),
            ("acks", "all"),
            ("enable.idempotence", "true"),
            ("linger.ms", &linger),
            ("message.timeout.ms", &timeout),
            ("message.max.bytes", &max_bytes),
        ])
    }
}

/// Parses `key=value`.
pub fn parse_key_value(s: &str) -> Result<(String, String), String> {
    let (k, v) = s.split_once('=').ok_or_else(|| format!("expected key=value, got {s:?}"))?;
    if k.trim().is_empty() {
        return Err(format!("empty key in {s:?}"));
    }
    Ok((k.trim().to_owned(), v.trim().to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_options_override_sluice_settings() {
        let args = KafkaClientArgs {
            brokers: "b:1".into(),
            options: vec![("linger.ms".into(), "0".into()), ("security.protocol".into(), "SASL_SSL".into())],
        };
        let config = args.producer_config("c", 1000, 5);
        assert_eq!(config.get("linger.ms"), Some("0"));
        assert_eq!(config.get("acks"), Some("all"));
        assert_eq!(config.get("security.protocol"), Some("SASL_SSL"));
    }

    #[test]
    fn parses_key_values() {
        assert_eq!(parse_key_value("a.b = c=d"), Ok(("a.b".into(), "c=d".into())));
        assert!(parse_key_value("nokey").is_err());
        assert!(parse_key_value("=v").is_err());
    }
}
