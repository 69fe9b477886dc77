//! Which cluster, and which incarnation of each topic, a status store was read from: the
//! cluster id and the topics' ids (a topic deleted and re-created has a new id). A store kept
//! from another cluster, or from topics since re-created, holds positions that belong to other
//! data, and is rebuilt instead of read on from.

use std::collections::BTreeMap;
use std::ffi::{CStr, CString, c_char};
use std::time::{Duration, Instant};

use rdkafka::bindings as rd;
use rdkafka::consumer::{BaseConsumer, Consumer};
use sluice_service::kafka::KafkaClientArgs;

/// The cluster id and each topic's id (base64), as the brokers report them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub cluster: String,
    pub topics: BTreeMap<String, String>,
}

impl Identity {
    /// Whether a store read from `self` reads on as `now`: the same cluster, and every topic of
    /// both the same incarnation. A topic only in `now` is new to the store (read from its
    /// beginning); one only in `self` is no longer read.
    pub fn continues_as(&self, now: &Identity) -> bool {
        self.cluster == now.cluster
            && self
                .topics
                .iter()
                .all(|(topic, id)| now.topics.get(topic).is_none_or(|now_id| now_id == id))
    }
}

/// The identity of `topics` on the cluster `kafka` names, or why it could not be read within
/// `timeout` (a topic that does not exist is an error too: the view would read nothing of it).
pub fn fetch(kafka: &KafkaClientArgs, topics: &[&str], timeout: Duration) -> Result<Identity, String> {
    let consumer: BaseConsumer = kafka
        .whole_topic_config("sluice-status-identity")
        .create()
        .map_err(|e| e.to_string())?;
    let started = Instant::now();
    let cluster = consumer
        .client()
        .fetch_cluster_id(timeout)
        .ok_or("the cluster id was not reported")?;
    let left = timeout.saturating_sub(started.elapsed()).max(Duration::from_secs(1));
    let topics = topic_ids(consumer.client().native_ptr(), topics, left)?;
    Ok(Identity { cluster, topics })
}

/// `DescribeTopics` through librdkafka's admin API (not wrapped by the `rdkafka` crate).
fn topic_ids(rk: *mut rd::rd_kafka_t, topics: &[&str], timeout: Duration) -> Result<BTreeMap<String, String>, String> {
    let names: Vec<CString> = topics
        .iter()
        .map(|t| CString::new(*t).map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let mut pointers: Vec<*const c_char> = names.iter().map(|n| n.as_ptr()).collect();
    // SAFETY: every pointer below comes from librdkafka and is released once, after its last use;
    // `names` outlives the collection built from it.
    unsafe {
        let collection = rd::rd_kafka_TopicCollection_of_topic_names(pointers.as_mut_ptr(), pointers.len());
        let queue = rd::rd_kafka_queue_new(rk);
        rd::rd_kafka_DescribeTopics(rk, collection, std::ptr::null(), queue);
        let event = rd::rd_kafka_queue_poll(queue, timeout.as_millis().min(i32::MAX as u128) as i32);
        let result = if event.is_null() {
            Err(format!("the topics were not described within {timeout:?}"))
        } else if rd::rd_kafka_event_error(event) != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
            Err(text(rd::rd_kafka_event_error_string(event)))
        } else {
            let mut count = 0;
            let described = rd::rd_kafka_DescribeTopics_result_topics(rd::rd_kafka_event_DescribeTopics_result(event), &mut count);
            (0..count)
                .map(|i| {
                    let topic = *described.add(i);
                    let name = text(rd::rd_kafka_TopicDescription_name(topic));
                    let error = rd::rd_kafka_TopicDescription_error(topic);
                    if !error.is_null() && rd::rd_kafka_error_code(error) != rd::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR {
                        return Err(format!("{name}: {}", text(rd::rd_kafka_error_string(error))));
                    }
                    Ok((
                        name,
                        text(rd::rd_kafka_Uuid_base64str(rd::rd_kafka_TopicDescription_topic_id(topic))),
                    ))
                })
                .collect()
        };
        if !event.is_null() {
            rd::rd_kafka_event_destroy(event);
        }
        rd::rd_kafka_queue_destroy(queue);
        rd::rd_kafka_TopicCollection_destroy(collection);
        result
    }
}

/// A C string from librdkafka, or "" for none.
///
/// # Safety
/// `p` is null or a NUL-terminated string valid for this call.
unsafe fn text(p: *const c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        // SAFETY: as the caller promises.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}
