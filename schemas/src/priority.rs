//! A task's priority lane: which waiting work a worker's engine takes first. The `priority`
//! enums of the JSON Schemas (`generation.schema.json#/$defs/priority`) list the same names,
//! held to [`Priority::ALL`] by the contract test.

use serde::{Deserialize, Serialize};

/// A task's lane: `interactive` before `standard` before `batch`. Which tenants may ask for
/// which lane is the producer's configuration (`SLUICE_TENANT_LANES`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// A person waits for it: taken before any other lane's work.
    Interactive,
    /// The default.
    #[default]
    Standard,
    /// Bulk work: taken after the others, and never starved by them.
    Batch,
}

impl Priority {
    /// Every lane, best first.
    pub const ALL: [Priority; 3] = [Priority::Interactive, Priority::Standard, Priority::Batch];

    pub fn name(self) -> &'static str {
        match self {
            Priority::Interactive => "interactive",
            Priority::Standard => "standard",
            Priority::Batch => "batch",
        }
    }

    pub fn parse(name: &str) -> Option<Priority> {
        Priority::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Whether this is the default lane (a record leaves it out).
    pub fn is_standard(&self) -> bool {
        *self == Priority::Standard
    }
}

impl std::fmt::Display for Priority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_order_is_best_first() {
        for p in Priority::ALL {
            assert_eq!(Priority::parse(p.name()), Some(p));
            assert_eq!(serde_json::to_value(p).unwrap(), serde_json::json!(p.name()));
        }
        assert!(Priority::Interactive < Priority::Standard && Priority::Standard < Priority::Batch);
        assert_eq!(Priority::default(), Priority::Standard);
        assert_eq!(Priority::parse("urgent"), None);
    }
}
