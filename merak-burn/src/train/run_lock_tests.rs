use super::*;

/// A record of `holder` changed by `edit`, as its lock file would hold it.
fn record(edit: impl FnOnce(&mut Holder)) -> String {
    let mut h = Holder::this_process("other-token".into());
    edit(&mut h);
    serde_json::to_string(&h).expect("a record")
}

#[test]
fn a_lock_names_its_holder_is_joined_by_its_own_process_and_goes_with_it() {
    let dir = tempfile::tempdir().expect("a scratch folder");
    let folder = dir.path().join("run");
    let lock = RunLock::acquire(&folder).expect("a free folder");
    assert!(lock.taken());
    let text = std::fs::read_to_string(folder.join(LOCK_FILE)).expect("the lock file");
    let holder: Holder = serde_json::from_str(&text).expect("a record");
    assert_eq!(holder.pid, std::process::id());
    assert_eq!(holder.host, host_name());
    // The same process again (merak train's trainer inside its job): joined, not taken.
    let again = RunLock::acquire(&folder).expect("joined");
    assert!(!again.taken());
    drop(again);
    assert!(folder.join(LOCK_FILE).exists(), "a joined lock stays");
    drop(lock);
    assert!(!folder.join(LOCK_FILE).exists(), "released");
    assert!(RunLock::acquire(&folder).expect("free again").taken());
}

#[test]
fn a_folder_locked_by_another_live_process_is_refused_naming_it() {
    let dir = tempfile::tempdir().expect("a scratch folder");
    let path = dir.path().join(LOCK_FILE);
    // Another holder: the file lock on a descriptor of its own, its record naming process 1.
    std::fs::write(&path, record(|h| h.pid = 1)).expect("written");
    let other = File::open(&path).expect("opened");
    other.lock().expect("locked");
    let e = RunLock::acquire(dir.path()).expect_err("held");
    let msg = e.to_string();
    assert!(matches!(e, LockError::Held { .. }), "{msg}");
    assert!(
        msg.contains("pid 1 on host") && msg.contains("run.lock"),
        "{msg}"
    );
    assert!(msg.contains("since") && msg.contains("UTC"), "{msg}");
    drop(other);
    // Its holder gone (the file lock released, the record left behind): taken over.
    let lock = RunLock::acquire(dir.path()).expect("taken over");
    assert!(lock.taken());
    let text = std::fs::read_to_string(&path).expect("the lock file");
    assert!(
        text.contains(&format!("\"pid\": {}", std::process::id())),
        "{text}"
    );
}

#[test]
fn a_lock_of_another_host_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().expect("a scratch folder");
    let path = dir.path().join(LOCK_FILE);
    let text = record(|h| {
        h.host = "elsewhere".into();
        h.boot = Some("another-boot".into());
    });
    std::fs::write(&path, &text).expect("written");
    let msg = RunLock::acquire(dir.path())
        .expect_err("refused")
        .to_string();
    assert!(
        msg.contains("another host") && msg.contains("elsewhere") && msg.contains("remove"),
        "{msg}"
    );
    assert_eq!(std::fs::read_to_string(&path).expect("kept"), text);
    // The same host name after a restart (another boot id): its holder is gone.
    std::fs::write(&path, record(|h| h.boot = Some("before-a-restart".into()))).expect("written");
    assert!(RunLock::acquire(dir.path()).expect("taken over").taken());
}

#[test]
fn a_file_that_is_not_a_lock_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().expect("a scratch folder");
    let path = dir.path().join(LOCK_FILE);
    std::fs::write(&path, "someone's notes").expect("written");
    let msg = RunLock::acquire(dir.path())
        .expect_err("refused")
        .to_string();
    assert!(msg.contains("not a lock file merak wrote"), "{msg}");
    assert_eq!(
        std::fs::read_to_string(&path).expect("kept"),
        "someone's notes"
    );
    // A link at the lock file's place is never followed.
    let target = dir.path().join("target.txt");
    std::fs::write(&target, "precious").expect("written");
    std::fs::remove_file(&path).expect("removed");
    std::os::unix::fs::symlink(&target, &path).expect("linked");
    assert!(RunLock::acquire(dir.path()).is_err());
    assert_eq!(std::fs::read_to_string(&target).expect("kept"), "precious");
}

#[test]
fn several_folders_are_locked_once_each_and_released_together() {
    let dir = tempfile::tempdir().expect("a scratch folder");
    let (out, root) = (dir.path().join("run"), dir.path().join("ckpt"));
    let locks = RunLocks::acquire(&[&out, &root, &out]).expect("free");
    assert_eq!(locks.taken().len(), 2);
    drop(locks);
    assert!(!out.join(LOCK_FILE).exists() && !root.join(LOCK_FILE).exists());
}

#[test]
fn a_dead_process_is_told_from_a_live_one() {
    let me = Holder::this_process("t".into());
    assert!(me.alive());
    let mut reused = me.clone();
    reused.process_start = me.process_start.map(|s| s + 1);
    assert!(
        !reused.alive(),
        "the same pid started at another time is another process"
    );
}
