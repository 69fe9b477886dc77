//! Test support inside the crate: a fake backend for unit tests of the batching and pipeline state
//! machines ([`fake`], unit tests only), and the fault injection that end-to-end tests switch on
//! through `SLUICE_TEST_FAULTS` ([`faults`]: wraps real adapters; never on in production).

#[cfg(test)]
pub(crate) mod fake;
pub(crate) mod faults;
