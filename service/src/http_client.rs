//! The one way to build an HTTP client: reqwest over rustls with ring as the process's crypto
//! provider. reqwest and object_store are built without a provider of their own (aws-lc's C
//! build was the largest single cost of a cold build), so the provider is installed here, once,
//! before any client is built; building a client any other way would panic. `clippy.toml`
//! refuses reqwest's own constructors and `reqwest::get` elsewhere, and `AmazonS3Builder::build`
//! where the provider was not installed first.

use std::sync::Once;

/// Installs ring as the process's rustls crypto provider, once. Call it before building an
/// object_store client (`AmazonS3Builder::build`); [`client`] and [`builder`] call it.
pub fn install_crypto_provider() {
    static INSTALL: Once = Once::new();
    // Another provider installed first (by a library) serves as well: keep it.
    INSTALL.call_once(|| drop(rustls::crypto::ring::default_provider().install_default()));
}

/// A client builder, the crypto provider installed.
#[allow(clippy::disallowed_methods)]
pub fn builder() -> reqwest::ClientBuilder {
    install_crypto_provider();
    reqwest::Client::builder()
}

/// A client with reqwest's defaults, the crypto provider installed. Panics where the TLS
/// backend cannot be initialised, as `reqwest::Client::new` does.
pub fn client() -> reqwest::Client {
    builder().build().expect("an HTTP client with rustls and ring")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_builds_and_the_provider_is_ring() {
        let _ = client();
        let provider = rustls::crypto::CryptoProvider::get_default().expect("installed");
        let ring = rustls::crypto::ring::default_provider();
        let names = |p: &rustls::crypto::CryptoProvider| p.cipher_suites.iter().map(|s| s.suite()).collect::<Vec<_>>();
        assert_eq!(names(provider), names(&ring));
        install_crypto_provider(); // twice is fine
    }
}
