//! Reading a config: the file and `--set` overrides merged over the defaults, unknown keys and
//! non-finite values refused naming the key, presets expanded.

use std::path::Path;

use merak_gpt::GptConfig;
use toml::Value;

use super::{Config, ConfigError, bad};

pub(super) fn default_value() -> Value {
    Value::try_from(Config::default()).expect("the default config serializes")
}

/// Every key a config may set, each holding a value of its type: the defaults', those of
/// `[model.moe]` (absent unless set, its optional capacity factor too), `train.cuda_device`
/// and `parallel.reduce_scatter` (absent unless set). Keys are checked against it, and type
/// errors located by probing it.
pub(super) fn known_keys() -> Value {
    let mut known = default_value();
    set_key(&mut known, "train.cuda_device", Value::Integer(0));
    set_key(
        &mut known,
        "parallel.reduce_scatter",
        Value::String("step".into()),
    );
    let moe = merak_burn::moe::MoeConfig {
        capacity_factor: Some(1.0),
        ..merak_burn::moe::MoeConfig::new(1, 1, 1)
    };
    if let Ok(moe) = Value::try_from(moe) {
        set_key(&mut known, "model.moe", moe);
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
        let key = join_key(prefix, name);
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
    match value {
        Value::Float(x) if !x.is_finite() && !NON_FINITE_ALLOWED.contains(&prefix) => bad(
            prefix,
            format!("{x} is not a finite number (nan, inf and values beyond 1.8e308 are refused)"),
        ),
        Value::Table(t) => t
            .iter()
            .try_for_each(|(k, v)| check_finite(v, &join_key(prefix, k))),
        Value::Array(a) => a
            .iter()
            .enumerate()
            .try_for_each(|(i, v)| check_finite(v, &format!("{prefix}[{i}]"))),
        _ => Ok(()),
    }
}

/// The dotted key of `name` under `prefix` (`""`: the top level).
pub(super) fn join_key(prefix: &str, name: &str) -> String {
    match prefix {
        "" => name.to_string(),
        _ => format!("{prefix}.{name}"),
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
    let from_file = match file {
        Some((text, shown)) => Some((read_file(text, shown, &known)?, shown)),
        None => None,
    };
    let mut user =
        (from_file.as_ref()).map_or_else(|| Value::Table(Default::default()), |f| f.0.clone());
    apply_sets(&mut user, sets, &known)?;
    // Base: the defaults, then the model preset if one is named, then the user's keys.
    let mut merged = default_value();
    if let Some(shape) = preset_shape(&user)? {
        let mut model = toml::Table::new();
        model.insert("model".into(), shape);
        merge(&mut merged, Value::Table(model));
    }
    merge(&mut merged, user);
    let checked = check_finite(&merged, "")
        .and_then(|()| deserialize_named(merged))
        .and_then(|cfg| cfg.validate().map(|()| cfg));
    checked.map_err(|e| match &from_file {
        Some((file, shown)) => name_file(e, file, shown, sets),
        None => e,
    })
}

/// `e` naming the config file `shown` when the key it refuses holds a value set there (in
/// `file`), not by a `--set` override.
fn name_file(e: ConfigError, file: &Value, shown: &str, sets: &[String]) -> ConfigError {
    let ConfigError::BadValue { key, .. } = &e else {
        return e;
    };
    let overridden = sets
        .iter()
        .any(|s| s.split_once('=').is_some_and(|(k, _)| k.trim() == key));
    match value_at(file, key) {
        Some(v) if !v.is_table() && !overridden => ConfigError::InFile {
            path: shown.to_string(),
            source: Box::new(e),
        },
        _ => e,
    }
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

/// `v` as a config; otherwise serde's message and the dotted key its span points at (`None`:
/// no span).
fn parse_config(v: &Value) -> Result<Config, (String, Option<String>)> {
    let text = toml::to_string(v).map_err(|e| (e.to_string(), None))?;
    toml::from_str(&text).map_err(|e: toml::de::Error| {
        let key = e.span().and_then(|span| key_at(&text, span.start));
        (e.message().to_string(), key)
    })
}

/// Deserializes a merged config so that a type error names its whole key and the type it
/// expects.
pub(super) fn deserialize_named(v: Value) -> Result<Config, ConfigError> {
    let (msg, key) = match parse_config(&v) {
        Ok(cfg) => return Ok(cfg),
        Err(e) => e,
    };
    let key = key.unwrap_or_default();
    let missing = (msg.strip_prefix("missing field `"))
        .and_then(|rest| rest.split_once('`'))
        .and_then(|(field, _)| missing_key(&v, &known_keys(), &key, field));
    if let Some((table, field)) = missing {
        // A key without a default, in a table set only in part (`[model.moe]`).
        return Err(ConfigError::BadValue {
            key: format!("{table}.{field}"),
            msg: format!("is missing: [{table}] has no default for it"),
        });
    }
    // Serde names only the section of a key inside the GPT keys flattened into [model]
    // (`model` for `model.hidden` and `model.moe.top_k`): find the key whose value alone
    // is refused.
    let (key, msg) = match value_at(&v, &key) {
        Some(Value::Table(_)) | None => failing_leaf(&v, &key).unwrap_or((key, msg)),
        Some(_) => (key, msg),
    };
    let msg = value_at(&v, &key).map_or(msg.clone(), |value| with_expected(&key, value, msg));
    let key = if key.is_empty() {
        "(config)".into()
    } else {
        key
    };
    Err(ConfigError::BadValue { key, msg })
}

/// The value at dotted path `key` of `v` (`""`: `v`).
pub(super) fn value_at<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    (key.split('.'))
        .filter(|p| !p.is_empty())
        .try_fold(v, |cur, part| cur.get(part))
}

/// The first key at or under dotted path `section` of `config` whose value, set alone in an
/// otherwise valid config ([`known_keys`]), does not deserialize: the key and serde's message.
fn failing_leaf(config: &Value, section: &str) -> Option<(String, String)> {
    let base = known_keys();
    let mut leaves = Vec::new();
    collect_leaves(value_at(config, section)?, section, &mut leaves);
    leaves.into_iter().find_map(|(key, value)| {
        let mut probe = base.clone();
        set_key(&mut probe, &key, value.clone());
        let (msg, _) = parse_config(&probe).err()?;
        Some((key, msg))
    })
}

/// Every value of `v` (at dotted path `path`) that is not a table, with its dotted key.
fn collect_leaves<'a>(v: &'a Value, path: &str, out: &mut Vec<(String, &'a Value)>) {
    match v {
        Value::Table(t) => t
            .iter()
            .for_each(|(name, sub)| collect_leaves(sub, &join_key(path, name), out)),
        leaf => out.push((path.to_string(), leaf)),
    }
}

/// Serde's message `msg` for `value` at `key`, with the type the key expects where the
/// message lacks it: for a named choice TOML says only "wanted string or table" (`schedule =
/// 3`) and serde "expected string or map" inside [model]; the choices are read from the
/// message of a probe that sets a string there (or strings in the value's shape).
fn with_expected(key: &str, value: &Value, msg: String) -> String {
    let wants_array = value_at(&known_keys(), key).is_some_and(Value::is_array);
    let shown = match value {
        Value::String(s) => format!("invalid type: string {s:?}"),
        Value::Array(_) if wants_array => format!("invalid entry in array `{value}`"),
        other => format!("invalid type: {} `{other}`", other.type_str()),
    };
    if msg.starts_with("expected") {
        return format!("{shown}, {msg}");
    }
    if !(msg.contains("wanted string or table") || msg.contains("expected string or map")) {
        return msg;
    }
    let expected = [as_strings(value), Value::String("?".into())]
        .into_iter()
        .find_map(|probe_value| {
            let mut probe = known_keys();
            set_key(&mut probe, key, probe_value);
            let (m, _) = parse_config(&probe).err()?;
            let at = m.find("expected")?;
            (!m.contains("string or map")).then(|| m[at..].to_string())
        });
    match expected {
        Some(expected) => format!("{shown}, {expected}"),
        None => msg,
    }
}

/// `v` with every value that is not a table or an array replaced by the string `"?"`.
fn as_strings(v: &Value) -> Value {
    match v {
        Value::Array(a) => Value::Array(a.iter().map(as_strings).collect()),
        Value::Table(t) => {
            Value::Table(t.iter().map(|(k, v)| (k.clone(), as_strings(v))).collect())
        }
        _ => Value::String("?".into()),
    }
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
    find_missing(
        value_at(config, section)?,
        value_at(known, section)?,
        section,
        field,
    )
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
        find_missing(sub, sub_known, &join_key(path, name), field)
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
