//! The memory a worker holds across model reloads, from the reports of `POST /admin/reload`, and
//! the bound a leak would break: RSS after later reloads against RSS after the warm-up ones.

use std::ops::{Range, RangeFrom};

use serde_json::Value;

/// RSS of one reload, in bytes: right after the model was dropped, and once it is loaded again.
#[derive(Debug, Clone, Copy)]
pub struct ReloadRss {
    pub after_unload: u64,
    pub after: u64,
}

impl ReloadRss {
    /// From one entry of a reload report's `reloads`.
    pub fn of(report: &Value) -> ReloadRss {
        let rss = |at: &str| {
            report[at]["rss_bytes"]
                .as_u64()
                .unwrap_or_else(|| panic!("no {at}.rss_bytes in {report}"))
        };
        ReloadRss {
            after_unload: rss("after_unload"),
            after: rss("after"),
        }
    }
}

/// Asserts that the highest RSS after the reloads of `measured` stays within `bound` bytes of the
/// highest after the reloads of `baseline` (a window, not one sample: a reload can land between
/// batches or in the middle of one), and prints the figures under `what`. A leak grows with the
/// number of reloads; the allocator's working set does not.
pub fn assert_rss_bounded(what: &str, rss: &[ReloadRss], baseline: Range<usize>, measured: RangeFrom<usize>, bound: u64) {
    let highest = |r: &[ReloadRss]| r.iter().map(|r| r.after).max().expect("reloads in the window");
    let (base, worst) = (highest(&rss[baseline.clone()]), highest(&rss[measured.clone()]));
    let mb = |b: u64| b >> 20;
    eprintln!(
        "{what} reload RSS: first {} MB, highest after reloads {}..{} {} MB, highest after reloads {}.. {} MB, last {} MB, lowest after an unload {} MB; bound {} MB of growth",
        mb(rss[0].after),
        baseline.start + 1,
        baseline.end,
        mb(base),
        measured.start + 1,
        mb(worst),
        mb(rss[rss.len() - 1].after),
        mb(rss.iter().map(|r| r.after_unload).min().expect("reloads")),
        mb(bound)
    );
    assert!(
        worst <= base + bound,
        "{what}: RSS after reloads grew from {base} to {worst} bytes (bound {bound})"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_past_the_bound_fails_and_noise_within_it_does_not() {
        let of = |after: u64| ReloadRss {
            after_unload: after / 2,
            after,
        };
        let flat: Vec<_> = [100, 120, 110, 115, 125].map(of).to_vec();
        assert_rss_bounded("flat", &flat, 0..2, 2.., 10);
        let leaking: Vec<_> = [100, 110, 120, 130, 140].map(of).to_vec();
        assert!(std::panic::catch_unwind(|| assert_rss_bounded("leaking", &leaking, 0..2, 2.., 10)).is_err());
    }
}
