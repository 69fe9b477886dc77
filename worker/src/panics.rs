//! Panics in model code are bugs, but a bug triggered by one task must fail that task, not the
//! batch, the partition or the process: prepare, render and backend calls run under
//! [`catch`], and a panic becomes an error carrying the panic message.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};

/// Runs `f`; a panic becomes `Err("panicked: <message>")`.
pub(crate) fn catch<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| format!("panicked: {}", message(payload.as_ref())))
}

/// The text of a panic payload (`panic!("...")` carries a `&str` or a `String`).
fn message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_error_with_its_message() {
        assert_eq!(catch(|| 7), Ok(7));
        assert_eq!(catch(|| -> u8 { panic!("boom {}", 3) }), Err("panicked: boom 3".to_owned()));
        assert_eq!(catch(|| -> u8 { panic!("static") }), Err("panicked: static".to_owned()));
    }
}
