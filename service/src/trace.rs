//! W3C trace context (`traceparent`) carried through Kafka: the producer takes it from the HTTP
//! request (or starts a trace), writes it as a record header on the task, and the worker carries
//! the trace onto the task's completion, DLQ and progress records, each as a child span, so one
//! trace spans HTTP request → task → result. Logs carry the trace id.

/// The `traceparent` header (and record header) name.
pub const TRACEPARENT: &str = "traceparent";
/// The `tracestate` header, passed on within W3C's limits (see [`bounded_tracestate`]).
pub const TRACESTATE: &str = "tracestate";

/// W3C Trace Context's limits on `tracestate`: list members, and the characters a vendor must
/// propagate.
pub const TRACESTATE_MAX_MEMBERS: usize = 32;
pub const TRACESTATE_MAX_CHARS: usize = 512;
/// Members longer than this go first when the list is over [`TRACESTATE_MAX_CHARS`].
const TRACESTATE_LONG_MEMBER: usize = 128;

/// A `tracestate` value as it may be passed on: `None` for one that is malformed or has more
/// than 32 list members (the spec says to discard it whole); over 512 characters, members
/// longer than 128 characters are dropped, then members from the end, until it fits.
pub fn bounded_tracestate(value: &str) -> Option<String> {
    let members: Vec<&str> = value
        .split(',')
        .map(|m| m.trim_matches([' ', '\t']))
        .filter(|m| !m.is_empty())
        .collect();
    if members.is_empty() || members.len() > TRACESTATE_MAX_MEMBERS || !members.iter().all(|m| tracestate_member(m)) {
        return None;
    }
    let length = |ms: &[&str]| ms.iter().map(|m| m.len()).sum::<usize>() + ms.len().saturating_sub(1);
    let mut kept = members;
    if length(&kept) > TRACESTATE_MAX_CHARS {
        kept.retain(|m| m.len() <= TRACESTATE_LONG_MEMBER);
    }
    while length(&kept) > TRACESTATE_MAX_CHARS {
        kept.pop();
    }
    (!kept.is_empty()).then(|| kept.join(","))
}

/// `key=value` as W3C defines a list member: a key of at most 256 characters from
/// `a-z0-9_-*/@` starting with a letter or digit (at most one `@`), a value of at most 256
/// printable ASCII characters other than `,` and `=`, not ending in a space.
fn tracestate_member(member: &str) -> bool {
    let Some((key, value)) = member.split_once('=') else {
        return false;
    };
    let key_ok = !key.is_empty()
        && key.len() <= 256
        && key.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && key
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_-*/@".contains(c))
        && key.matches('@').count() <= 1;
    let value_ok = !value.is_empty()
        && value.len() <= 256
        && !value.ends_with(' ')
        && value.bytes().all(|b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=');
    key_ok && value_ok
}

/// A parsed `traceparent`: version 00.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, chunk) in s.as_bytes().chunks(2).enumerate() {
        out[i] = u8::from_str_radix(std::str::from_utf8(chunk).ok()?, 16).ok()?;
    }
    Some(out)
}

fn random<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    loop {
        for b in &mut out {
            *b = fastrand::u8(..);
        }
        if out.iter().any(|b| *b != 0) {
            return out; // all-zero ids are invalid
        }
    }
}

impl TraceContext {
    /// Parses a version-00 `traceparent`; `None` for anything malformed (then a new trace starts,
    /// as the spec says).
    pub fn parse(value: &str) -> Option<TraceContext> {
        let mut parts = value.trim().split('-');
        let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version != "00" || parts.next().is_some() {
            return None;
        }
        let trace_id = unhex::<16>(trace).filter(|t| t.iter().any(|b| *b != 0))?;
        let span_id = unhex::<8>(span).filter(|s| s.iter().any(|b| *b != 0))?;
        let flags = unhex::<1>(flags)?[0];
        Some(TraceContext {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
        })
    }

    /// A new trace.
    pub fn root() -> TraceContext {
        TraceContext {
            trace_id: random(),
            span_id: random(),
            sampled: true,
        }
    }

    /// A child span of the same trace.
    pub fn child(&self) -> TraceContext {
        TraceContext {
            span_id: random(),
            ..*self
        }
    }

    /// A child span whose id is derived from this span's and `salt` (FNV-1a): the same record
    /// handled again names the same span, and every record a task's processing writes carries one
    /// span id — the one its exported span has.
    pub fn derived(&self, salt: &[u8]) -> TraceContext {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.span_id.iter().chain(salt) {
            hash ^= u64::from(*b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        TraceContext {
            span_id: hash.max(1).to_be_bytes(),
            ..*self
        }
    }

    /// The `traceparent` value.
    pub fn header(&self) -> String {
        format!("00-{}-{}-{:02x}", hex(&self.trace_id), hex(&self.span_id), u8::from(self.sampled))
    }

    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_formats_and_derives_children() {
        let v = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let t = TraceContext::parse(v).unwrap();
        assert_eq!(t.header(), v);
        let c = t.child();
        assert_eq!(c.trace_id, t.trace_id);
        assert_ne!(c.span_id, t.span_id);
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        ] {
            assert!(TraceContext::parse(bad).is_none(), "{bad}");
        }
        let d = t.derived(b"sluice.tasks.v1/3/42");
        assert_eq!(d, t.derived(b"sluice.tasks.v1/3/42"));
        assert_ne!(d.span_id, t.derived(b"sluice.tasks.v1/3/43").span_id);
        assert_eq!(d.trace_id, t.trace_id);
        let root = TraceContext::root();
        assert_eq!(TraceContext::parse(&root.header()), Some(root));
    }

    #[test]
    fn tracestate_is_kept_within_w3c_limits() {
        assert_eq!(bounded_tracestate("vendor=abc").as_deref(), Some("vendor=abc"));
        assert_eq!(bounded_tracestate(" a=1 , b@x=2,, ").as_deref(), Some("a=1,b@x=2"));
        for bad in ["", "novalue", "Upper=1", "a=b=c", "a=x y=z", "a@b@c=1", "a=\u{7f}"] {
            assert_eq!(bounded_tracestate(bad), None, "{bad:?}");
        }
        // More than 32 members: discarded whole.
        let many: Vec<String> = (0..33).map(|i| format!("k{i}=v")).collect();
        assert_eq!(bounded_tracestate(&many.join(",")), None);
        assert!(bounded_tracestate(&many[..32].join(",")).is_some());
        // Over 512 characters: long members go first, then members from the end.
        let long = format!("long={}", "x".repeat(200));
        let short: Vec<String> = (0..30).map(|i| format!("k{i:02}={}", "y".repeat(20))).collect();
        let value = format!("{},{long},{}", short[0], short[1..].join(","));
        let kept = bounded_tracestate(&value).unwrap();
        assert!(kept.len() <= TRACESTATE_MAX_CHARS, "{}", kept.len());
        assert!(!kept.contains("long=") && kept.starts_with("k00=") && kept.split(',').count() < 30);
        let huge = format!("a={}", "z".repeat(300));
        assert_eq!(bounded_tracestate(&huge), None, "a value over 256 characters is malformed");
    }
}
