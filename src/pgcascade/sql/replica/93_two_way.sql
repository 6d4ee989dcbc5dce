-- Two-way replication (docs/two-way.md): the server side of a master's apply of its peers.
--
-- Versions.  A row's version is (commit time on its origin, origin master).  A row written here
-- by a local transaction has this master as origin and its commit time from
-- track_commit_timestamp (its xmin).  A row last written by a peer's apply has a row_version
-- entry whose xid is that apply's transaction: it keeps the origin's own commit time, so every
-- master compares the same versions and last-update-wins converges.  A deleted row leaves a
-- tombstone there (local deletes through pgcascade.record_tombstones).  A row the first copy of
-- its table from a peer wrote (pgcascade.peer_copy) is that peer's, older than any change.
--
-- Seen.  A remote change conflicts with the local version only if the peer had not applied
-- that version when it made its change.  Each master's apply of a peer's batch writes a marker
-- into its own queue ('pgcascade.peer-seen': ev_data = the peer's tick, ev_extra1 = the peer,
-- ev_extra2 = that tick's snapshot); reading a peer's events in order, the last marker before
-- a change says how far the peer had applied each origin.

-- (pgcascade.commit_time(xid8), the transaction's commit time: sql/pgq/52_fetch.sql)

-- pgcascade.xid8_of(xid) -> the full transaction id of a recent 32-bit one (a row's xmin): the
-- one nearest to the current snapshot's xmax, before or after it (this transaction's own id,
-- assigned after its statement's snapshot was taken, is past that xmax).
create or replace function pgcascade.xid8_of(i_xid xid) returns xid8
language sql stable as $$
    select (r + ((x - r % 4294967296 + 6442450944) % 4294967296 - 2147483648))::text::xid8
      from (select pg_snapshot_xmax(pg_current_snapshot())::text::int8 r, i_xid::text::int8 x) s
$$;

-- pgcascade.key_array_expr(alias, keys) -> the SQL expression of a row's key as a jsonb array.
create or replace function pgcascade.key_array_expr(i_alias text, i_keys text[]) returns text
language sql immutable as $$
    select format('jsonb_build_array(%s)',
                  array_to_string(array(select format('%s.%I', i_alias, k) from unnest(i_keys) k), ', '))
$$;

-- pgcascade.record_tombstones(): AFTER DELETE statement trigger on a master's two-way tables
-- (TG_ARGV = the key columns).  A local delete leaves a tombstone, so a peer's concurrent change
-- to that row is seen as a conflict and resolved by time.  A peer's apply (pgcascade.origin
-- set) writes its own.  (Masters made two-way before migration 11 run it AFTER UPDATE too, for
-- key changes, until two_way_table makes them again: record_key_tombstone does that now.)
create or replace function pgcascade.record_tombstones() returns trigger
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    v_key_old text := pgcascade.key_array_expr('o', TG_ARGV::text[]);
begin
    if coalesce(current_setting('pgcascade.origin', true), '') <> '' then
        return null;
    end if;
    execute format(
        'insert into pgcascade.row_version (table_name, row_key, origin, origin_tick, origin_time, xid, deleted)'
        ' select %L, %s, null, null, null, pg_current_xact_id(), true from pgcascade_old o %s'
        ' on conflict (table_name, row_key) do update set origin = null, origin_tick = null,'
        ' origin_time = null, xid = excluded.xid, deleted = true',
        format('%I.%I', TG_TABLE_SCHEMA, TG_TABLE_NAME), v_key_old,
        case when TG_OP = 'UPDATE'
             then format('where not exists (select 1 from pgcascade_new n where %s = %s)',
                         pgcascade.key_array_expr('n', TG_ARGV::text[]), v_key_old)
             else '' end);
    return null;
end $$;

-- pgcascade.record_key_tombstone(): AFTER UPDATE row trigger, only when the key changed (its WHEN
-- clause): the old key is gone, as by a delete.  Ordinary updates never fire it.
create or replace function pgcascade.record_key_tombstone() returns trigger
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    v_key jsonb;
begin
    if coalesce(current_setting('pgcascade.origin', true), '') <> '' then
        return null;
    end if;
    execute format('select %s from (select ($1).*) o', pgcascade.key_array_expr('o', TG_ARGV::text[]))
       into v_key using old;
    insert into pgcascade.row_version (table_name, row_key, origin, origin_tick, origin_time, xid, deleted)
    values (format('%I.%I', TG_TABLE_SCHEMA, TG_TABLE_NAME), v_key, null, null, null, pg_current_xact_id(), true)
    on conflict (table_name, row_key) do update set origin = null, origin_tick = null,
       origin_time = null, xid = excluded.xid, deleted = true;
    return null;
end $$;

-- pgcascade.tombstone_key_trigger(table, keys) -> void: the row trigger that records a tombstone
-- of a row's old key when an UPDATE changed it, in the form that fits the table (92_key_triggers.sql).
create or replace function pgcascade.tombstone_key_trigger(i_table regclass, i_keys text[]) returns void
language sql as $$
    select pgcascade.key_trigger_make('_pgcascade_tombstone_key', i_table, i_keys, 'old.%I is distinct from new.%I',
        format('pgcascade.record_key_tombstone(%s)',
               array_to_string(array(select quote_literal(k) from unnest(i_keys) k), ', ')))
$$;

-- pgcascade.two_way_table(table, keys, on) -> void: make a set table of a master two-way (its
-- capture triggers fire in a peer's apply too, which runs as a replica session; tombstones of
-- local deletes and truncates: 94_two_way_truncate.sql) or one-way again.
create or replace function pgcascade.two_way_table(i_table regclass, i_keys text[], i_on bool) returns void
language plpgsql as $$
declare
    t text;
    st record;
begin
    -- already so: no ALTER TABLE (its lock would wait for, and hold up, the table's writers)
    if (select count(*) from pg_trigger where tgrelid = i_table
         and tgname in ('_pgcascade_tombstone_key', '_pgcascade_tombstone_trunc')) = (case when i_on then 2 else 0 end)
       and not exists (select 1 from pg_trigger where tgrelid = i_table and tgname like '\_pgcascade\_capture\_%'
                          and (tgenabled = 'A') <> i_on) then
        return;
    end if;
    foreach t in array array['_pgcascade_capture_ins', '_pgcascade_capture_upd', '_pgcascade_capture_del',
                             '_pgcascade_capture_trunc', '_pgcascade_capture_key'] loop
        if exists (select 1 from pg_trigger where tgrelid = i_table and tgname = t) then
            execute format('alter table %s enable %s trigger %I', i_table, case when i_on then 'always' else '' end, t);
        end if;
    end loop;
    execute format('drop trigger if exists _pgcascade_tombstone_del on %s', i_table);
    execute format('drop trigger if exists _pgcascade_tombstone_upd on %s', i_table);  -- made before migration 11
    execute format('drop trigger if exists _pgcascade_tombstone_key on %s', i_table);
    execute format('drop trigger if exists _pgcascade_tombstone_trunc on %s', i_table);
    if i_on then
        execute format('create trigger _pgcascade_tombstone_del after delete on %s referencing old table as pgcascade_old'
                       ' for each statement execute function pgcascade.record_tombstones(%s)',
                       i_table, array_to_string(array(select quote_literal(k) from unnest(i_keys) k), ', '));
        perform pgcascade.tombstone_key_trigger(i_table, i_keys);
        execute format('create trigger _pgcascade_tombstone_trunc after truncate on %s'
                       ' for each statement execute function pgcascade.record_truncate()', i_table);
    end if;
    -- their functions read pgcascade.forward only where they fire ALWAYS (90_capture.sql)
    for st in select s.queue_name, s.key_columns, s.event_format from pgcascade.set_table s
               where to_regclass(s.table_name) = i_table
                 and exists (select 1 from pg_trigger where tgrelid = i_table and tgname = '_pgcascade_capture_ins')
    loop
        perform 1 from pgcascade.queue where queue_name = st.queue_name for update;
        perform pgcascade.capture_functions(st.queue_name, i_table, st.key_columns, st.event_format);
    end loop;
end $$;

-- pgcascade.missing_row_expr(table) -> the SQL expression of a row of the table holding, in each
-- column added with a default since rows were written, that value for the rows written before
-- (attmissingval), and null in the others.  A peer's change made before it ran an ADD COLUMN
-- that this master ran already has no such column in its image: on the peer, that row has
-- the column's value for old rows, so this master gives it the same (json_populate_record
-- keeps the base row's value of a column missing from the image).
create or replace function pgcascade.missing_row_expr(i_table regclass) returns text
language sql stable as $$
    select case when bool_or(a.atthasmissing) then
               format('row(%s)::%s', string_agg(
                   case when a.atthasmissing
                        then format('(%L::text[])[1]::%s', a.attmissingval::text, format_type(a.atttypid, a.atttypmod))
                        else format('null::%s', format_type(a.atttypid, a.atttypmod)) end,
                   ', ' order by a.attnum), i_table)
           else format('null::%s', i_table) end
      from pg_attribute a where a.attrelid = i_table and a.attnum > 0 and not a.attisdropped
$$;

-- pgcascade.peer_apply_begin(own_queue, peer) -> whether the batch's changes are passed on: first
-- in the transaction of a peer's batch.  What it writes is the peer's (pgcascade.origin: the
-- capture tags it, peers take no tagged event).  It is captured for this master's own queue only
-- while a consumer other than its peers (a leaf, a branch, a sink) is registered there
-- (pgcascade.forward, read by the capture functions): else nobody would read it.  Registrations
-- take the same lock exclusively and tick after it, so a new consumer's first batch begins after
-- every apply that passed nothing on.
create or replace function pgcascade.peer_apply_begin(i_own_queue text, i_peer text) returns bool
language plpgsql as $$
declare
    v_queue int4;
    v_forward bool;
begin
    perform set_config('pgcascade.origin', i_peer, true);
    select queue_id into v_queue from pgcascade.queue where queue_name = i_own_queue;
    perform pg_advisory_xact_lock_shared(pgcascade.registration_lock(), v_queue);
    select exists (
        select 1 from pgcascade.subscription s join pgcascade.consumer c on c.co_id = s.sub_consumer
         where s.sub_queue = v_queue and left(c.co_name, 1) <> '.'  -- '.global_watermark', ...
           and not exists (select 1 from pgcascade.node n
                            where n.peer_of = i_own_queue and n.provider_node = c.co_name))
      into v_forward;
    perform set_config('pgcascade.forward', case when v_forward then 'on' else 'off' end, true);
    return v_forward;
end $$;

-- pgcascade.peer_policies_hash(peer_queue) -> what the peer apply's statements were composed by:
-- the subscription's conflict policy and the tables' own.  PL/pgSQL, as columns_signature, for
-- the plan its query keeps in the session: it is checked at every small peer batch.
create or replace function pgcascade.peer_policies_hash(i_peer_queue text) returns text
language plpgsql stable as $$
begin
    return md5(coalesce((select conflict_policy from pgcascade.node where queue_name = i_peer_queue), '') || ';'
               || coalesce((select string_agg(table_name || '=' || conflict_policy, ',' order by table_name)
                              from pgcascade.subscriber_table
                             where queue_name = i_peer_queue and conflict_policy is not null), ''));
end $$;

-- pgcascade.peer_batch_begin(own_queue, peer_queue, peer, prev_tick, policies) -> peer_apply_begin:
-- first in the one round trip a small peer batch is applied in (replica/peer_worker.py), where
-- nothing can be looked at before the statements run: the node row locked, and the batch
-- refused (nothing applied) unless it starts where this node's record is (SQLSTATE PCB01) and
-- the policies are those the statements were composed by (PCB02).  The worker applies it the
-- step-by-step way then, which looks at each.
create or replace function pgcascade.peer_batch_begin(
    i_own_queue text, i_peer_queue text, i_peer text, i_prev_tick int8, i_policies text) returns bool
language plpgsql as $$
declare
    n pgcascade.node;
begin
    select * into n from pgcascade.node where queue_name = i_peer_queue for update;
    if not found or n.peer_of is distinct from i_own_queue or n.provider_node is distinct from i_peer
       or coalesce(n.last_tick <> i_prev_tick, false) then
        raise exception 'batch of % not after this node''s last tick', i_peer_queue using errcode = 'PCB01';
    end if;
    if pgcascade.peer_policies_hash(i_peer_queue) is distinct from i_policies then
        raise exception 'conflict policies of % changed', i_peer_queue using errcode = 'PCB02';
    end if;
    return pgcascade.peer_apply_begin(i_own_queue, i_peer);
end $$;

-- The apply of a peer's batch is one statement per table, composed by replica/peer_apply.py;
-- these end it when it must not stand.

-- pgcascade.peer_conflict_stop(kind, table, key, peer, policy): a conflict whose policy gave no
-- winner ('error', or a function's other answer) stops the batch; nothing of it is applied.
create or replace function pgcascade.peer_conflict_stop(
    i_kind text, i_table text, i_key jsonb, i_peer text, i_policy text) returns int8
language plpgsql as $$
begin
    raise exception '% conflict on % key % from %: the policy is "%"', i_kind, i_table, i_key, i_peer, i_policy
        using hint = 'change the policy (add-peer --conflict) or the row, then the worker goes on from this batch';
end $$;

-- pgcascade.columns_signature(table) -> what the peer apply's statement of the table depends on:
-- its columns (name, type, generated, identity, value for old rows), in order - as the versions
-- of their rows in pg_attribute: any change to a column (DDL) writes a new version of its row,
-- whose xmin differs (some harmless ones too, a column's statistics target or grants: the batch
-- is then applied again with its statements composed anew).  Checked by every statement of a
-- peer batch, it costs an index probe: the same by names and format_type() cost 0.08 ms a call.
-- PL/pgSQL, not SQL: a SQL function that cannot be inlined (this one reads a table) is parsed
-- and planned at every call; a PL/pgSQL one keeps its query's plan for the session.
create or replace function pgcascade.columns_signature(i_table regclass) returns text
language plpgsql stable as $$
begin
    return (select md5(string_agg(a.attnum || ':' || a.xmin, ',' order by a.attnum))
              from pg_attribute a where a.attrelid = i_table and a.attnum > 0);
end $$;

-- pgcascade.peer_columns_check(table, signature): the table's columns changed (DDL here) since
-- its statement was composed: the batch is applied again, with a statement composed anew.
create or replace function pgcascade.peer_columns_check(i_table regclass, i_signature text) returns int8
language plpgsql stable as $$
begin
    if pgcascade.columns_signature(i_table) is distinct from i_signature then
        raise exception 'the columns of % changed while a peer''s batch was applied', i_table
            using errcode = '40001', hint = 'the worker applies the batch again';
    end if;
    return 0;
end $$;

-- pgcascade.peer_apply_raced(table, peer): a local transaction inserted a key the apply judged
-- absent, or deleted a row it was locking: the batch is applied again (the worker retries it).
create or replace function pgcascade.peer_apply_raced(i_table text, i_peer text) returns int8
language plpgsql as $$
begin
    raise exception 'a row of % was inserted or deleted here while a change of % to it was applied', i_table, i_peer
        using errcode = '40001', hint = 'the worker applies the batch again';
end $$;

-- pgcascade.peer_expect_rows(n, expected, table) -> true: a peer batch's statement that needs no
-- judging (replica/peer_fast.py) wrote `n` rows, not `expected`: something here could make one
-- of them a conflict.  SQLSTATE PCROW, the table in the detail: nothing of the batch stands, the
-- worker applies it with the judging statements and judges that table's next batches for a while.
create or replace function pgcascade.peer_expect_rows(n int8, expected int8, i_table text) returns bool
language plpgsql as $$
begin
    if n <> expected then
        raise exception 'the statement of % wrote % rows, not %', i_table, n, expected
            using errcode = 'PCROW', detail = i_table;
    end if;
    return true;
end $$;

-- Drop the per-table apply function of migration 10's releases.
drop function if exists pgcascade.apply_peer_rows(text, text, text, text, regclass, text[], text[], int8, int8, int8, text);

-- pgcascade.peer_batch_done(own_queue, peer_queue, peer, tick, tick_snapshot) -> void: after a
-- peer's batch is applied here, in its transaction: what the peer had applied of each origin
-- (the batch's markers), and this master's own marker for its peers.  The markers are the
-- staged ones, or, for a small batch applied in one round trip (replica/peer_worker.py), the
-- JSON array set in the transaction as pgcascade.peer_markers ([ev_id, ev_txid, ev_type, ev_data,
-- ev_extra1, ev_time, ev_extra2]), with pgcascade.peer_changes saying whether the batch has
-- changes: that path touches no temporary table (any access to one makes the commit truncate
-- the ON COMMIT DELETE ROWS stage).
create or replace function pgcascade.peer_batch_done(
    i_own_queue text, i_peer_queue text, i_peer text, i_tick int8, i_snapshot text)
returns void
language plpgsql as $$
declare
    v_seen jsonb := nullif(current_setting('pgcascade.peer_markers', true), '')::jsonb;
    v_changes bool;
begin
    if i_snapshot is null then  -- a marker without it would make the peers judge conflicts wrongly
        raise exception 'peer_batch_done: no snapshot for tick % of %', i_tick, i_peer_queue;
    end if;
    if v_seen is not null then
        insert into pgcascade.peer_seen (queue_name, origin, seen_tick, seen_snapshot)
        select distinct on (e->>4) i_peer_queue, e->>4, (e->>3)::int8, (e->>6)::pg_snapshot
          from jsonb_array_elements(v_seen) e where e->>2 = 'pgcascade.peer-seen'
         order by e->>4, (e->>0)::int8 desc
        on conflict (queue_name, origin) do update
           set seen_tick = excluded.seen_tick, seen_snapshot = excluded.seen_snapshot;
        v_changes := current_setting('pgcascade.peer_changes') = 'on';
    else
        insert into pgcascade.peer_seen (queue_name, origin, seen_tick, seen_snapshot)
        select distinct on (ev_extra1) i_peer_queue, ev_extra1, ev_data::int8, ev_extra2::pg_snapshot
          from pg_temp.pgcascade_stage where ev_type = 'pgcascade.peer-seen'
         order by ev_extra1, ev_id desc
        on conflict (queue_name, origin) do update
           set seen_tick = excluded.seen_tick, seen_snapshot = excluded.seen_snapshot;
        v_changes := exists (select 1 from pg_temp.pgcascade_stage where ev_type not like 'pgcascade.%');
    end if;
    -- only after changes: a batch of markers alone changed no row here, and answering it would
    -- make the masters send markers back and forth for ever
    if v_changes then
        -- a master with logical capture: its daemon queues the master's own commits from the
        -- WAL, a moment after them.  Inserted here at once, the marker would overtake changes
        -- committed before this apply that the daemon had not queued yet, and its peers would
        -- take them for changes made after this batch (judged no conflict: the masters
        -- diverged).  So it goes through the WAL too, in its place, untagged (its peers read it)
        if exists (select 1 from pgcascade.walcapture where queue_name = i_own_queue) then
            perform pg_logical_emit_message(true, 'pgcascade', json_build_object(
                'queue', i_own_queue, 'type', 'pgcascade.peer-seen', 'data', i_tick::text,
                'extra1', i_peer, 'extra2', i_snapshot, 'untagged', true)::text);
        else
            perform pgcascade.insert_event(i_own_queue, 'pgcascade.peer-seen', i_tick::text, i_peer, i_snapshot, null, null);
        end if;
    end if;
end $$;

-- pgcascade.peer_batch_end(own_queue, peer_queue, peer, tick, tick_snapshot) -> whether the node
-- follows sequences of its peer: the end of a small peer batch applied in one round trip
-- (replica/peer_worker.py), peer_batch_done and the tick recorded as applied in one call (each
-- statement of that message costs its parse and plan).
create or replace function pgcascade.peer_batch_end(
    i_own_queue text, i_peer_queue text, i_peer text, i_tick int8, i_snapshot text)
returns bool
language plpgsql as $$
begin
    perform pgcascade.peer_batch_done(i_own_queue, i_peer_queue, i_peer, i_tick, i_snapshot);
    update pgcascade.node set last_tick = i_tick, last_error = null, last_error_time = null
     where queue_name = i_peer_queue;
    return exists (select 1 from pgcascade.subscriber_seq where queue_name = i_peer_queue);
end $$;

-- pgcascade.spread_sequence(seq, step, start) -> void: a two-way master's share of a sequence:
-- every step-th value from start on (its peers take the other residues).
create or replace function pgcascade.spread_sequence(i_seq regclass, i_step int4, i_start int8) returns void
language plpgsql as $$
begin
    execute format('alter sequence %s increment by %s', i_seq, i_step);
    perform setval(i_seq, i_start, false);
end $$;
