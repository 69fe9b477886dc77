//! Weighted fairness between tenants within a lane: start-time fair queueing. Each task gets a
//! virtual start tag when it arrives, `max(now, its tenant's last finish)`, and its tenant's
//! finish moves on by the task's rows over the tenant's weight; the batcher takes tasks in tag
//! order. A tenant that floods the queue takes turns with one that sends a task now and then,
//! each getting the device in proportion to its weight (`SLUICE_TENANT_WEIGHTS`), instead of the
//! later one waiting behind the whole flood.

use std::collections::HashMap;

/// Virtual time per row of a tenant of weight 1.
const ROW: u64 = 1 << 20;
/// Tenants remembered at most; past it, those whose finish is behind the virtual clock (as good
/// as new) are forgotten.
const MAX_TENANTS: usize = 4096;

/// The tenants' weights (`tenant=weight` entries; every other tenant weighs 1).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantWeights(HashMap<String, u32>);

impl TenantWeights {
    /// `tenant=weight,…` as the setting is written.
    pub fn from_arg(arg: &str) -> Result<TenantWeights, String> {
        TenantWeights::parse(&arg.split(',').map(str::to_owned).collect::<Vec<_>>())
    }

    pub fn parse(entries: &[String]) -> Result<TenantWeights, String> {
        let mut weights = HashMap::new();
        for entry in entries.iter().map(|e| e.trim()).filter(|e| !e.is_empty()) {
            let bad = || format!("tenant weight {entry:?}: expected tenant=weight, a weight from 1 to 1000");
            let (tenant, weight) = entry.split_once('=').ok_or_else(bad)?;
            let weight: u32 = weight.trim().parse().ok().filter(|w| (1..=1000).contains(w)).ok_or_else(bad)?;
            if tenant.trim().is_empty() {
                return Err(bad());
            }
            weights.insert(tenant.trim().to_owned(), weight);
        }
        Ok(TenantWeights(weights))
    }

    fn of(&self, tenant: &str) -> u64 {
        u64::from(self.0.get(tenant).copied().unwrap_or(1))
    }
}

/// The virtual clock and each tenant's last finish tag.
#[derive(Debug, Default)]
pub(crate) struct Fair {
    weights: TenantWeights,
    /// The start tag of the latest task handed out.
    now: u64,
    finish: HashMap<String, u64>,
}

impl Fair {
    pub fn new(weights: TenantWeights) -> Fair {
        Fair {
            weights,
            ..Fair::default()
        }
    }

    /// The start tag of a task of `tenant` with `rows` rows, arriving now.
    pub fn arrive(&mut self, tenant: &str, rows: usize) -> u64 {
        if self.finish.len() >= MAX_TENANTS && !self.finish.contains_key(tenant) {
            let now = self.now;
            self.finish.retain(|_, f| *f > now);
        }
        let cost = (rows.max(1) as u64).saturating_mul(ROW) / self.weights.of(tenant);
        let finish = self.finish.entry(tenant.to_owned()).or_insert(0);
        let start = (*finish).max(self.now);
        *finish = start.saturating_add(cost.max(1));
        start
    }

    /// A task with start tag `tag` was handed out.
    pub fn served(&mut self, tag: u64) {
        self.now = self.now.max(tag);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hands out the queued tags in order, `n` of them, returning the tenants served.
    fn serve(fair: &mut Fair, queued: &mut Vec<(u64, &'static str)>, n: usize) -> Vec<&'static str> {
        queued.sort();
        let served: Vec<(u64, &str)> = queued.drain(..n.min(queued.len())).collect();
        for (tag, _) in &served {
            fair.served(*tag);
        }
        served.into_iter().map(|(_, t)| t).collect()
    }

    #[test]
    fn a_tenant_sending_now_and_then_is_not_held_behind_a_flood() {
        let mut fair = Fair::default();
        let mut queued: Vec<(u64, &str)> = (0..100).map(|_| (fair.arrive("flood", 1), "flood")).collect();
        // Ten served; then a task of another tenant arrives: it goes within the next two.
        serve(&mut fair, &mut queued, 10);
        queued.push((fair.arrive("light", 1), "light"));
        let next = serve(&mut fair, &mut queued, 2);
        assert!(next.contains(&"light"), "{next:?}");
    }

    #[test]
    fn backlogged_tenants_share_by_weight_and_rows() {
        let weights = TenantWeights::parse(&["heavy=3".into(), " ".into()]).unwrap();
        let mut fair = Fair::new(weights);
        let mut queued: Vec<(u64, &str)> = Vec::new();
        for _ in 0..100 {
            queued.push((fair.arrive("heavy", 1), "heavy"));
            queued.push((fair.arrive("plain", 1), "plain"));
            // Four rows a task: a quarter of plain's share in tasks.
            queued.push((fair.arrive("big", 4), "big"));
        }
        let first = serve(&mut fair, &mut queued, 80);
        let count = |t: &str| first.iter().filter(|s| **s == t).count();
        // Rows shared 3 : 1 : 1, so tasks 3 : 1 : 1/4: of 80, ~56, ~19 and ~5.
        assert!((53..=60).contains(&count("heavy")), "{}", count("heavy"));
        assert!((16..=21).contains(&count("plain")), "{}", count("plain"));
        assert!((3..=6).contains(&count("big")), "{}", count("big"));
    }

    #[test]
    fn weights_are_parsed_and_bounded() {
        assert!(TenantWeights::parse(&["a=0".into()]).is_err());
        assert!(TenantWeights::parse(&["a=1001".into()]).is_err());
        assert!(TenantWeights::parse(&["=2".into()]).is_err());
        assert!(TenantWeights::parse(&["a".into()]).is_err());
        assert_eq!(TenantWeights::parse(&["a = 5".into()]).unwrap().of("a"), 5);
        assert_eq!(TenantWeights::default().of("anyone"), 1);
    }
}
