//! JSON as diffusers writes it. diffusers saves every config with Python's `json` module, which
//! writes non-finite floats as bare `NaN`, `Infinity` and `-Infinity` (a DPMSolver config's
//! `lambda_min_clipped` is `-Infinity` by default), tokens JSON and `serde_json` refuse. [`parse`]
//! reads such a file: each of those tokens outside a string becomes a string of the same
//! spelling, and a float field read through [`float`] takes it back as the value Python meant.

use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// The tokens Python's `json` writes for non-finite floats, longest first.
const NON_FINITE: [(&str, f64); 3] = [("-Infinity", f64::NEG_INFINITY), ("Infinity", f64::INFINITY), ("NaN", f64::NAN)];

/// Parses `text`, accepting Python's bare non-finite floats (as strings of the same spelling).
pub fn parse(text: &str) -> Result<Value, serde_json::Error> {
    serde_json::from_str(&quote_non_finite(text))
}

/// `text` with every bare `NaN`, `Infinity` and `-Infinity` outside a string put in quotes.
fn quote_non_finite(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 16);
    let mut in_string = false;
    let mut escaped = false;
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
        } else if c == '"' {
            in_string = true;
        } else if let Some((token, _)) = NON_FINITE.iter().find(|(t, _)| rest.starts_with(t)) {
            out.push('"');
            out.push_str(token);
            out.push('"');
            rest = &rest[token.len()..];
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// An optional float as [`parse`] leaves it: a number, null, or one of Python's non-finite
/// spellings. For `#[serde(default, deserialize_with = "python_json::float")]`.
pub fn float<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    match Option::<Value>::deserialize(d)? {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_f64()
            .map(Some)
            .ok_or_else(|| serde::de::Error::custom(format!("{n} is not a float"))),
        Some(Value::String(s)) => NON_FINITE
            .iter()
            .find(|(t, _)| *t == s)
            .map(|&(_, v)| Some(v))
            .ok_or_else(|| serde::de::Error::custom(format!("{s:?} is not a float"))),
        Some(other) => Err(serde::de::Error::custom(format!("{other} is not a float"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct Config {
        #[serde(default, deserialize_with = "float")]
        lambda_min_clipped: Option<f64>,
        #[serde(default, deserialize_with = "float")]
        high: Option<f64>,
        #[serde(default, deserialize_with = "float")]
        odd: Option<f64>,
        #[serde(default, deserialize_with = "float")]
        plain: Option<f64>,
        #[serde(default, deserialize_with = "float")]
        absent: Option<f64>,
        name: String,
    }

    /// What `json.dumps({...}, indent=2)` writes for these values in Python 3.11.
    const WRITTEN_BY_PYTHON: &str = r#"{
  "lambda_min_clipped": -Infinity,
  "high": Infinity,
  "odd": NaN,
  "plain": 0.5,
  "name": "a \"NaN\" and -Infinity, \\ kept as written"
}"#;

    #[test]
    fn reads_non_finite_floats_as_python_writes_them() {
        assert!(serde_json::from_str::<Value>(WRITTEN_BY_PYTHON).is_err(), "plain JSON refuses them");
        let c: Config = serde_json::from_value(parse(WRITTEN_BY_PYTHON).unwrap()).unwrap();
        assert_eq!(c.lambda_min_clipped, Some(f64::NEG_INFINITY));
        assert_eq!(c.high, Some(f64::INFINITY));
        assert!(c.odd.unwrap().is_nan());
        assert_eq!(c.plain, Some(0.5));
        assert_eq!(c.absent, None);
        assert_eq!(c.name, r#"a "NaN" and -Infinity, \ kept as written"#, "strings are left alone");
    }

    #[test]
    fn other_strings_and_types_are_not_floats() {
        for text in [r#"{"plain": "inf", "name": ""}"#, r#"{"plain": true, "name": ""}"#] {
            let parsed = parse(text).unwrap();
            assert!(serde_json::from_value::<Config>(parsed).is_err(), "{text}");
        }
        assert!(parse(r#"{"a": -Inf}"#).is_err(), "only Python's own spellings");
    }
}
