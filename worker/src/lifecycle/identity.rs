//! Who the worker is to its group and to the transaction coordinator when nothing configured
//! says (`SLUICE_GROUP_INSTANCE_ID`, `SLUICE_TRANSACTIONAL_ID`): the lowest free *slot* of its
//! group on its host, held as a lock on `slot-<n>.lock` in `SLUICE_RUNTIME_DIR/<group>/`.
//!
//! A supervisor (systemd, a shell loop, Nomad) that restarts a killed worker at once starts it
//! under a new process id. With an identity of its own per process, each restart is a new group
//! member and a new transactional id: the dead member's partitions wait out its session and its
//! open transaction waits out the transaction timeout, while more kills arrive, and a crash
//! loop stalls the group. The kernel releases a dead process's lock, so a worker restarted on
//! the same host takes its slot back: the same `group.instance.id` (it rejoins with its
//! partitions, no rebalance) and the same transactional id (it fences its previous instance and
//! aborts that one's open transaction at once). Two live workers on one host never hold the
//! same slot. On Kubernetes the chart sets `SLUICE_GROUP_INSTANCE_ID` to the pod name instead;
//! `SLUICE_IDENTITY=process` turns slots off (dynamic membership, `<host>-<pid>`).

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

use crate::config::{Config, GroupProtocol, IdentityKind};

/// Slots tried before giving up (a host runs far fewer workers of one group).
const MAX_SLOTS: u32 = 1024;

/// A slot held for the life of the process (its lock goes with the file).
#[derive(Debug)]
pub(super) struct HostSlot {
    _lock: File,
    pub(super) slot: u32,
    pub(super) path: PathBuf,
}

/// Holds the lowest free slot of `dir`.
fn claim(dir: &Path) -> std::io::Result<HostSlot> {
    std::fs::create_dir_all(dir)?;
    for slot in 0..MAX_SLOTS {
        let path = dir.join(format!("slot-{slot}.lock"));
        let file = OpenOptions::new().create(true).truncate(false).write(true).open(&path)?;
        match file.try_lock() {
            Ok(()) => return Ok(HostSlot { _lock: file, slot, path }),
            Err(TryLockError::WouldBlock) => continue,
            Err(TryLockError::Error(e)) => return Err(e),
        }
    }
    Err(std::io::Error::other(format!(
        "all {MAX_SLOTS} slots in {} are held",
        dir.display()
    )))
}

/// A group name as a directory name: what is not `[A-Za-z0-9._-]` becomes `_`.
fn dir_name(group: &str) -> String {
    let name: String = group
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '_' })
        .collect();
    if name.is_empty() || name.chars().all(|c| c == '.') {
        "_".into()
    } else {
        name
    }
}

/// Settles the worker's identity: a host slot when none is configured (and slots are on),
/// written into `config` as its group instance id (classic protocol) and its transactional id.
/// The slot must be kept for as long as the worker runs. A runtime directory that cannot be
/// used leaves the process identity, with a WARN.
pub(super) fn settle(config: &mut Config) -> Option<HostSlot> {
    let k = &config.kafka;
    if config.identity.identity == IdentityKind::Process || k.group_instance_id.is_some() {
        return None;
    }
    let dir = config.identity.runtime_dir().join(dir_name(&k.group_id));
    let held = match claim(&dir) {
        Ok(held) => held,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "no host slot; this worker's identity is its process (a restart is a new group member)");
            return None;
        }
    };
    let identity = format!("{}-{}", crate::config::host_name(), held.slot);
    // Under KIP-848 a static member restarted after a kill is fenced until its session expires:
    // there the slot names the transactional id only.
    if k.group_protocol == GroupProtocol::Classic {
        config.kafka.group_instance_id = Some(identity.clone());
    }
    if config.delivery.transactional_id.is_none() {
        config.delivery.transactional_id = Some(format!("{}.{identity}", config.kafka.group_id));
    }
    tracing::info!(slot = held.slot, lock = %held.path.display(), identity, "identity from this host's lowest free slot");
    Some(held)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_workers_never_share_a_slot_and_a_dead_ones_is_taken_back() {
        let dir = std::env::temp_dir().join(format!("sluice-slots-{}", uuid::Uuid::new_v4()));
        let a = claim(&dir).unwrap();
        let b = claim(&dir).unwrap();
        assert_eq!((a.slot, b.slot), (0, 1));
        drop(a); // the process holding it died: the kernel drops its lock
        let again = claim(&dir).unwrap();
        assert_eq!(again.slot, 0, "the lowest free slot: the dead worker's");
        assert_eq!(claim(&dir).unwrap().slot, 2);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn group_names_make_safe_directory_names() {
        assert_eq!(dir_name("sluice-workers"), "sluice-workers");
        assert_eq!(dir_name("../etc/passwd"), ".._etc_passwd");
        assert_eq!(dir_name(".."), "_");
        assert_eq!(dir_name(""), "_");
    }
}
