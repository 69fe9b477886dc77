//! W3C trace context (`traceparent`) carried through Kafka: the producer takes it from the HTTP
//! request (or starts a trace), writes it as a record header on the task, and the worker carries
//! the trace onto the task's completion, DLQ and progress records, each as a child span, so one
//! trace spans HTTP request → task → result. Logs carry the trace id.

/// The `traceparent` header (and record header) name.
pub const TRACEPARENT: &str = "traceparent";
/// The `tracestate` header, passed through unchanged.
pub const TRACESTATE: &str = "tracestate";

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
}
