//! Reading a config: the file and `--set` overrides merged over the defaults, unknown keys and
//! non-finite values refused naming the key, presets expanded.

use std::path::Path;

use merak_gpt::GptConfig;
use toml::Value;

use super::{Config, ConfigError, bad};

pub(super) fn default_value() -> Value {
    Value::try_from(Config::default()).expect("the default config serializes")
}

/// Keys without a default value (absent unless set), as (section, key).
pub(super) const OPTIONAL_KEYS: [(&str, &str); 1] = [("train", "cuda_device")];

/// Every key a config may set: the defaults' and the optional ones.
pub(super) fn known_keys() -> Value {
    let mut known = default_value();
    for (section, key) in OPTIONAL_KEYS {
        if let Some(Value::Table(t)) = known.get_mut(section) {
            t.insert(key.into(), Value::Boolean(true));
        }
    }
    // `[model.moe]`, absent unless set: every key of it, the optional capacity factor too.
    let moe = merak_burn::moe::MoeConfig {
        capacity_factor: Some(1.0),
        ..merak_burn::moe::MoeConfig::new(1, 1, 1)
    };
    if let (Some(Value::Table(t)), Ok(moe)) = (known.get_mut("model"), Value::try_from(moe)) {
        t.insert("moe".into(), moe);
    }
    known
}

/// Checks every key of `user` against `known`, recursively; `prefix` is the dotted path so far.
/// A table where `known` has a value (`model.kind.x`) is an unknown key, a value where
/// `known` has a table (`model = 3`) a bad value: keys added later are checked alike.
pub(super) fn check_keys(user: &Value, known: &Value, prefix: &str) -> Result<(), ConfigError> {
    let (u, k) = match (user, known) {
        (Value::Table(u), Value::Table(k)) => (u, k),
        (Value::Table(u), _) => {
            let Some(name) = u.keys().next() else {
                return bad(prefix, "is a value, not a table".into());
            };
            return Err(ConfigError::UnknownKey {
                key: format!("{prefix}.{name}"),
                hint: format!(" (`{prefix}` is a value, not a table)"),
            });
        }
        (_, Value::Table(_)) => {
            return bad(prefix, format!("is a table ([{prefix}]), not a value"));
        }
        _ => return Ok(()),
    };
    for (name, v) in u {
        let key = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}.{name}")
        };
        match k.get(name) {
            Some(kv) => check_keys(v, kv, &key)?,
            None => {
                return Err(ConfigError::UnknownKey {
                    key,
                    hint: format!(
                        " (known keys{}: {})",
                        if prefix.is_empty() {
                            String::new()
                        } else {
                            format!(" in [{prefix}]")
                        },
                        k.keys().cloned().collect::<Vec<_>>().join(", ")
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Keys whose value may be NaN or infinite; every other float of a config must be finite.
pub(super) const NON_FINITE_ALLOWED: [&str; 0] = [];

/// Refuses every float of `value` (a whole config, at dotted path `prefix`) that is NaN or
/// infinite, naming its key (`key[i]` inside an array), unless [`NON_FINITE_ALLOWED`] lists
/// the key.
pub(super) fn check_finite(value: &Value, prefix: &str) -> Result<(), ConfigError> {
    let child = |name: &str| {
        if prefix.is_empty() {
            name.to_string()
        } else {
            format!("{prefix}.{name}")
        }
    };
    match value {
        Value::Float(x) if !x.is_finite() && !NON_FINITE_ALLOWED.contains(&prefix) => bad(
            prefix,
            format!("{x} is not a finite number (nan, inf and values beyond 1.8e308 are refused)"),
        ),
        Value::Table(t) => t.iter().try_for_each(|(k, v)| check_finite(v, &child(k))),
        Value::Array(a) => a
            .iter()
            .enumerate()
            .try_for_each(|(i, v)| check_finite(v, &format!("{prefix}[{i}]"))),
        _ => Ok(()),
    }
}

/// Overlays `top` onto `base`, table by table.
pub(super) fn merge(base: &mut Value, top: Value) {
    match (base, top) {
        (Value::Table(b), Value::Table(t)) => {
            for (k, v) in t {
                match b.get_mut(&k) {
                    Some(bv) => merge(bv, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, t) => *b = t,
    }
}

/// Parses the text of a `--set` value: a TOML literal (number, boolean, quoted string, array),
/// a number beyond TOML's floats (`1e309`, infinite, so that it is refused as not finite) or,
/// failing those, a bare string.
pub(super) fn parse_literal(text: &str) -> Value {
    toml::from_str::<toml::Table>(&format!("v = {text}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .or_else(|| {
            let numeric = text.bytes().any(|b| b.is_ascii_digit());
            let x: f64 = text.parse().ok().filter(|_| numeric)?;
            x.is_infinite().then_some(Value::Float(x))
        })
        .unwrap_or_else(|| Value::String(text.to_string()))
}

pub(super) fn set_key(root: &mut Value, key: &str, value: Value) {
    let mut cur = root;
    let parts: Vec<&str> = key.split('.').collect();
    for p in &parts[..parts.len() - 1] {
        let Value::Table(t) = cur else { return };
        cur = t
            .entry(p.to_string())
            .or_insert_with(|| Value::Table(Default::default()));
    }
    if let Value::Table(t) = cur {
        t.insert(parts[parts.len() - 1].to_string(), value);
    }
}

/// Reads a config file (or starts from the built-in default when `path` is `None`), applies
/// `--set` overrides, and checks every key and value.
pub fn load(path: Option<&Path>, sets: &[String]) -> Result<Config, ConfigError> {
    let file = match path {
        Some(path) => {
            let shown = path.display().to_string();
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: shown.clone(),
                source,
            })?;
            Some((text, shown))
        }
        None => None,
    };
    load_text(file.as_ref().map(|(t, n)| (t.as_str(), n.as_str())), sets)
}

/// Like [`load`], from the text of a config (`(text, where it came from)`).
pub fn load_text(file: Option<(&str, &str)>, sets: &[String]) -> Result<Config, ConfigError> {
    let known = known_keys();
    let mut user = match file {
        Some((text, shown)) => read_file(text, shown, &known)?,
        None => Value::Table(Default::default()),
    };
    apply_sets(&mut user, sets, &known)?;
    // Base: the defaults, then the model preset if one is named, then the user's keys.
    let mut merged = default_value();
    if let Some(shape) = preset_shape(&user)? {
        let mut model = toml::Table::new();
        model.insert("model".into(), shape);
        merge(&mut merged, Value::Table(model));
    }
    merge(&mut merged, user);
    check_finite(&merged, "")?;
    let cfg: Config = deserialize_named(merged)?;
    cfg.validate()?;
    Ok(cfg)
}

/// The keys of a config file's `text` (from `shown`), checked against `known` and for
/// non-finite floats; errors name the file.
pub(super) fn read_file(text: &str, shown: &str, known: &Value) -> Result<Value, ConfigError> {
    let user = Value::Table(toml::from_str(text).map_err(|e: toml::de::Error| {
        // Name the key of the offending line too (`lr = 1e309` under [train]).
        let key = e.span().and_then(|span| key_at(text, span.start));
        ConfigError::Parse {
            path: shown.to_string(),
            msg: match key {
                Some(key) => format!("at key `{key}`: {e}"),
                None => e.to_string(),
            },
        }
    })?);
    let in_file = |source| ConfigError::InFile {
        path: shown.to_string(),
        source: Box::new(source),
    };
    check_keys(&user, known, "").map_err(in_file)?;
    check_finite(&user, "").map_err(in_file)?;
    Ok(user)
}

/// Applies `--set key=value` overrides to `user` in order (a key set twice: the later wins),
/// checking each key, then every value, against `known`.
pub(super) fn apply_sets(
    user: &mut Value,
    sets: &[String],
    known: &Value,
) -> Result<(), ConfigError> {
    for s in sets {
        let (key, text) = s
            .split_once('=')
            .ok_or_else(|| ConfigError::SetSyntax(s.clone()))?;
        let key = key.trim();
        let mut probe = Value::Table(Default::default());
        set_key(&mut probe, key, Value::Boolean(true));
        check_keys(&probe, known, "")?;
        set_key(user, key, parse_literal(text.trim()));
    }
    // The values too: `--set model.kind={x=1}` names `model.kind.x`.
    check_keys(user, known, "")
}

/// The shape of the preset `model.preset` of `user` (of `model.kind`), if one is named.
pub(super) fn preset_shape(user: &Value) -> Result<Option<Value>, ConfigError> {
    let model = |key: &str| {
        user.get("model")
            .and_then(|m| m.get(key))
            .and_then(Value::as_str)
    };
    let (preset, kind) = (
        model("preset").unwrap_or(""),
        model("kind").unwrap_or("gpt"),
    );
    if preset.is_empty() {
        return Ok(None);
    }
    let bad = |msg: String| ConfigError::BadValue {
        key: "model.preset".into(),
        msg,
    };
    let shape = if kind == "bert" {
        let b = merak_bert::BertConfig::preset(preset).map_err(|e| bad(e.to_string()))?;
        Value::try_from(b).map_err(|e| bad(e.to_string()))?
    } else {
        let g = GptConfig::preset(preset).map_err(|e| bad(e.to_string()))?;
        Value::try_from(g).map_err(|e| bad(e.to_string()))?
    };
    Ok(Some(shape))
}

/// Deserializes section by section so that a type error names its key.
pub(super) fn deserialize_named(v: Value) -> Result<Config, ConfigError> {
    let text = toml::to_string(&v).map_err(|e| ConfigError::BadValue {
        key: "(config)".into(),
        msg: e.to_string(),
    })?;
    toml::from_str(&text).map_err(|e: toml::de::Error| {
        // Point at the key: the span of the error is inside the offending line.
        let key = e
            .span()
            .and_then(|span| key_at(&text, span.start))
            .unwrap_or_else(|| "(config)".into());
        let missing = (e.message().strip_prefix("missing field `"))
            .and_then(|rest| rest.split_once('`'))
            .and_then(|(field, _)| missing_key(&v, &known_keys(), &key, field));
        match missing {
            // A key without a default, in a table set only in part (`[model.moe]`).
            Some((table, field)) => ConfigError::BadValue {
                key: format!("{table}.{field}"),
                msg: format!("is missing: [{table}] has no default for it"),
            },
            None => ConfigError::BadValue {
                key,
                msg: e.message().to_string(),
            },
        }
    })
}

/// The table at or under dotted path `section` of `config` that lacks key `field` while the
/// known keys there include it: `(table's path, field)`. Serde names the outer section of a
/// missing key (`model` for `model.moe.top_k`, the GPT keys being flattened into it).
fn missing_key(
    config: &Value,
    known: &Value,
    section: &str,
    field: &str,
) -> Option<(String, String)> {
    let at = |v| {
        (section.split('.'))
            .filter(|p| !p.is_empty())
            .try_fold(v, |cur: &Value, part| cur.get(part))
    };
    find_missing(at(config)?, at(known)?, section, field)
}

/// [`missing_key`] within `config` (at dotted path `path`), depth first.
fn find_missing(
    config: &Value,
    known: &Value,
    path: &str,
    field: &str,
) -> Option<(String, String)> {
    let (Value::Table(c), Value::Table(k)) = (config, known) else {
        return None;
    };
    if k.contains_key(field) && !c.contains_key(field) {
        return Some((path.to_string(), field.to_string()));
    }
    c.iter().find_map(|(name, sub)| {
        let sub_known = k.get(name)?;
        find_missing(sub, sub_known, &format!("{path}.{name}"), field)
    })
}

/// The dotted key of the line containing byte `offset` of a serialized config.
pub(super) fn key_at(text: &str, offset: usize) -> Option<String> {
    let mut section = String::new();
    let mut pos = 0;
    for line in text.lines() {
        let end = pos + line.len();
        let t = line.trim();
        if t.starts_with('[') {
            section = t.trim_matches(|c| c == '[' || c == ']').to_string();
        }
        if offset <= end {
            if let Some((k, _)) = t.split_once('=') {
                let k = k.trim();
                return Some(if section.is_empty() {
                    k.to_string()
                } else {
                    format!("{section}.{k}")
                });
            }
            return (!section.is_empty()).then_some(section);
        }
        pos = end + 1;
    }
    None
}
