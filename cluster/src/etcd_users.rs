//! Turning on etcd's user authentication for a cluster: the `etcdctl` steps an operator takes,
//! as one call, so tests (and tools) set up exactly what the documentation describes.

use crate::error::ClusterError;
use crate::etcd::{call, EtcdConfig};
use crate::etcd_security::{EtcdCredentials, EtcdPassword};
use crate::record::cluster_prefix;

/// Creates `root` with `root_password`, a role named after `user.user` that may read and write
/// the keys of `admin.cluster` and nothing else, `user` with that role, and enables
/// authentication: what `etcdctl user add root; user grant-role root root; role add U; role
/// grant-permission U --prefix readwrite /fission/{cluster}/; user add U; user grant-role U U;
/// auth enable` does.
///
/// `admin` must be let in without a user (etcd's authentication still off); it fails if the
/// users or the role exist already.
pub async fn enable_etcd_auth(
    admin: &EtcdConfig,
    root_password: &EtcdPassword,
    user: &EtcdCredentials,
) -> Result<(), ClusterError> {
    let mut client = admin.connect().await?;
    let timeout = admin.request_timeout();
    let name = user.user.as_str();
    let prefix = cluster_prefix(&admin.cluster);
    let permission = etcd_client::Permission::read_write(prefix).with_prefix();
    call(
        "user add root",
        timeout,
        client.user_add("root", root_password.expose(), None),
    )
    .await?;
    call(
        "grant role root",
        timeout,
        client.user_grant_role("root", "root"),
    )
    .await?;
    call("role add", timeout, client.role_add(name)).await?;
    call(
        "role grant permission",
        timeout,
        client.role_grant_permission(name, permission),
    )
    .await?;
    call(
        "user add",
        timeout,
        client.user_add(name, user.password.expose(), None),
    )
    .await?;
    call("grant role", timeout, client.user_grant_role(name, name)).await?;
    call("auth enable", timeout, client.auth_enable()).await?;
    Ok(())
}
