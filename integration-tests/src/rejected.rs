//! What a rejected request's JSON error reply names: its `fields`, each with the field and why.

use serde_json::Value;

/// The `fields` of an error reply, in order, as `(field, message)` pairs. Panics, showing the
/// reply, when it has no `fields` array or an entry without both strings.
pub fn rejected_fields(reply: &Value) -> Vec<(&str, &str)> {
    let fields = reply["fields"].as_array().unwrap_or_else(|| panic!("no `fields` in {reply}"));
    fields
        .iter()
        .map(|f| match (f["field"].as_str(), f["message"].as_str()) {
            (Some(field), Some(message)) => (field, message),
            _ => panic!("a field error without `field` and `message` in {reply}"),
        })
        .collect()
}

/// Whether the reply names `field` among its rejected fields.
pub fn names_field(reply: &Value, field: &str) -> bool {
    rejected_fields(reply).iter().any(|(f, _)| *f == field)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_in_order_and_a_reply_without_them_fails() {
        let reply = serde_json::json!({"error": "invalid_request", "fields": [
            {"field": "width", "message": "too wide"}, {"field": "", "message": "the body"}]});
        assert_eq!(rejected_fields(&reply), vec![("width", "too wide"), ("", "the body")]);
        assert!(names_field(&reply, "width") && !names_field(&reply, "height"));
        let none = serde_json::json!({"error": "internal"});
        assert!(std::panic::catch_unwind(|| rejected_fields(&none).len()).is_err());
    }
}
