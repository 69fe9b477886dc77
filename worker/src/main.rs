//! `sluice-worker`: see the crate documentation.

use clap::Parser;
use sluice_service::{shutdown, telemetry};
use sluice_worker::config::Config;
use sluice_worker::{Models, run};

#[tokio::main]
async fn main() {
    let config = Config::parse();
    telemetry::init(config.log_format);
    let code = match run(config, Models::Onnx, shutdown::terminated()).await {
        Ok(exit) => exit.code(),
        Err(e) => {
            tracing::error!(error = %e, "worker stopped");
            2
        }
    };
    // Exit here rather than return: the Kafka clients are being dropped on a thread of their own
    // (their destructors wait on the broker), and everything that had to be acknowledged was.
    std::process::exit(code)
}
