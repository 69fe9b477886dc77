//! The compact list of offsets that commit metadata carries after the read lease
//! ([`crate::source::redelivery`]): ` name:` then comma-separated entries, `o` (offset o) or `a-b`
//! (every offset from a to b), either with `*n` for a count n other than 1. Two lists use it: the
//! records started and not finished ([`crate::source::crash_guard`]) and the records finished
//! ahead of the committed position ([`crate::source::done_ahead`]).
//!
//! Both directions are bounded: the broker refuses metadata over `offset.metadata.max.bytes`
//! (4 KiB by default), so a list is cut after its lowest offsets at a character budget; and a
//! list read back (written by anyone) yields at most [`MAX_PARSED`] offsets.

use std::collections::BTreeMap;
use std::fmt::Write;

/// The most offsets read back from one list (its ranges are not trusted).
const MAX_PARSED: usize = 16_384;

/// `entries` (offset and count, in ascending offset order) as the list named `marker`
/// (` started:`, say) in at most `max_chars` characters, lowest offsets first; and how many
/// entries fit (all of them, or the lowest that many). Empty when `entries` is.
pub(crate) fn encode(marker: &str, entries: impl IntoIterator<Item = (i64, u32)>, max_chars: usize) -> (String, usize) {
    let mut out = String::new();
    let mut fitted = 0;
    let mut entries = entries.into_iter().peekable();
    while let Some((first, n)) = entries.next() {
        let mut last = first;
        let mut span = 1;
        while let Some(&(next, m)) = entries.peek() {
            if next != last + 1 || m != n {
                break;
            }
            last = next;
            span += 1;
            entries.next();
        }
        let mut entry = if last == first {
            first.to_string()
        } else {
            format!("{first}-{last}")
        };
        if n != 1 {
            let _ = write!(entry, "*{n}");
        }
        let separator = if out.is_empty() { marker } else { "," };
        if out.len() + separator.len() + entry.len() > max_chars {
            break;
        }
        out.push_str(separator);
        out.push_str(&entry);
        fitted += span;
    }
    (out, fitted)
}

/// The list named `marker` in `metadata` (none when it has none, or was written by another
/// tool); it ends at the next space. Malformed entries are skipped, and at most [`MAX_PARSED`]
/// offsets are read.
pub(crate) fn parse(metadata: &str, marker: &str) -> BTreeMap<i64, u32> {
    let mut out = BTreeMap::new();
    let Some((_, rest)) = metadata.split_once(marker) else {
        return out;
    };
    let list = rest.split(' ').next().unwrap_or_default();
    for entry in list.split(',') {
        let (range, count) = match entry.split_once('*') {
            Some((range, count)) => (range, count.parse::<u32>().ok()),
            None => (entry, Some(1)),
        };
        let Some(count) = count.filter(|c| *c > 0) else { continue };
        let bounds = match range.split_once('-') {
            Some((a, b)) => a.parse::<i64>().ok().zip(b.parse::<i64>().ok()),
            None => range.parse::<i64>().ok().map(|o| (o, o)),
        };
        let Some((first, last)) = bounds.filter(|(a, b)| 0 <= *a && a <= b) else {
            continue;
        };
        for offset in first..=last {
            if out.len() >= MAX_PARSED {
                return out;
            }
            out.insert(offset, count);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_ends_where_the_next_one_begins() {
        let started: BTreeMap<i64, u32> = [(1, 1), (2, 1)].into();
        let done: BTreeMap<i64, u32> = [(5, 1), (6, 1), (7, 1), (9, 1)].into();
        let metadata = format!(
            "sluice-lease:10{}{}",
            encode(" started:", started.clone(), 100).0,
            encode(" done:", done.clone(), 100).0
        );
        assert_eq!(metadata, "sluice-lease:10 started:1-2 done:5-7,9");
        assert_eq!(parse(&metadata, " started:"), started);
        assert_eq!(parse(&metadata, " done:"), done);
    }

    #[test]
    fn a_cut_list_says_how_many_entries_it_holds() {
        let done: BTreeMap<i64, u32> = [(5, 1), (6, 1), (7, 1), (9, 1), (11, 1)].into();
        assert_eq!(encode(" done:", done.clone(), 100), (" done:5-7,9,11".to_string(), 5));
        assert_eq!(encode(" done:", done.clone(), 10), (" done:5-7".to_string(), 3));
        assert_eq!(encode(" done:", done.clone(), 5), (String::new(), 0));
    }
}
