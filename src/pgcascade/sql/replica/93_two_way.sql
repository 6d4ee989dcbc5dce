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

-- pgcascade.commit_time(xid8) -> the transaction's commit time (track_commit_timestamp), or null.
create or replace function pgcascade.commit_time(i_xid xid8) returns timestamptz
language sql stable as $$
    select pg_xact_commit_timestamp((i_xid::text::int8 % 4294967296)::text::xid)
$$;

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

-- pgcascade.record_key_tombstone(): AFTER UPDATE OF <key columns> row trigger, only when the key
-- changed (its WHEN clause): the old key is gone, as by a delete.  Ordinary updates never fire it.
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

-- pgcascade.two_way_table(table, keys, on) -> void: make a set table of a master two-way (its
-- capture triggers fire in a peer's apply too, which runs as a replica session; tombstones of
-- local deletes and truncates: 94_two_way_truncate.sql) or one-way again.
create or replace function pgcascade.two_way_table(i_table regclass, i_keys text[], i_on bool) returns void
language plpgsql as $$
declare
    t text;
begin
    -- already so: no ALTER TABLE (its lock would wait for, and hold up, the table's writers)
    if (select count(*) from pg_trigger where tgrelid = i_table
         and tgname in ('_pgcascade_tombstone_key', '_pgcascade_tombstone_trunc')) = (case when i_on then 2 else 0 end)
       and not exists (select 1 from pg_trigger where tgrelid = i_table and tgname like '\_pgcascade\_capture\_%'
                          and (tgenabled = 'A') <> i_on) then
        return;
    end if;
    foreach t in array array['_pgcascade_capture_ins', '_pgcascade_capture_upd', '_pgcascade_capture_del',
                             '_pgcascade_capture_trunc'] loop
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
        execute format('create trigger _pgcascade_tombstone_key after update of %s on %s for each row'
                       ' when (%s) execute function pgcascade.record_key_tombstone(%s)',
                       array_to_string(array(select quote_ident(k) from unnest(i_keys) k), ', '), i_table,
                       array_to_string(array(select format('old.%I is distinct from new.%I', k, k)
                                               from unnest(i_keys) k), ' or '),
                       array_to_string(array(select quote_literal(k) from unnest(i_keys) k), ', '));
        execute format('create trigger _pgcascade_tombstone_trunc after truncate on %s'
                       ' for each statement execute function pgcascade.record_truncate()', i_table);
    end if;
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

-- pgcascade.apply_peer_rows(peer_queue, peer, self, table, dest, keys, cols, lo, hi, tick, policy)
--   -> conflicts found.  (`cols` is no longer read: the table's columns here are.)
-- Applies one table's staged row events (lo <= ev_id < hi) of a peer's batch, set-based, with
-- conflict detection and resolution per key.  Runs without a savepoint, so that the rows it
-- writes carry the apply's own transaction id (row_version.xid).  The staged ev_time is the
-- change's commit time on the peer.
create or replace function pgcascade.apply_peer_rows(
    i_peer_queue text, i_peer text, i_self text, i_table text, i_dest regclass, i_keys text[], i_cols text[],
    i_lo int8, i_hi int8, i_tick int8, i_policy text)
returns int8
language plpgsql as $$
declare
    v_key_r text := pgcascade.key_array_expr('r', i_keys);
    v_match text := array_to_string(array(
        select format('t.%I = (n.row_key->>%s)::%s', k, i - 1,
                      format_type(a.atttypid, a.atttypmod))
          from unnest(i_keys) with ordinality u(k, i)
          join pg_attribute a on a.attrelid = i_dest and a.attname = u.k
         order by i), ' and ');
    -- every column the table has here now (not the columns both sides had when the worker read
    -- them: DDL on either master may have changed them since); one the peer's image lacks gets
    -- the value of old rows (missing_row_expr), one only the peer has is left out
    v_colnames text[] := array(select a.attname::text from pg_attribute a where a.attrelid = i_dest and a.attnum > 0
                                  and not a.attisdropped and a.attgenerated = '' order by a.attnum);
    v_cols text := array_to_string(array(select quote_ident(c) from unnest(v_colnames) c), ', ');
    v_base text := pgcascade.missing_row_expr(i_dest);
    v_rcols text := array_to_string(array(select 'r.' || quote_ident(c) from unnest(v_colnames) c), ', ');
    v_lww text := '(case when coalesce(n.local_time, ''-infinity'') < n.remote_time'
                  ' or (coalesce(n.local_time, ''-infinity'') = n.remote_time and n.local_origin < %L)'
                  ' then ''remote'' else ''local'' end)';
    v_fuw text := '(case when coalesce(n.local_time, ''-infinity'') > n.remote_time'
                  ' or (coalesce(n.local_time, ''-infinity'') = n.remote_time and n.local_origin > %L)'
                  ' then ''remote'' else ''local'' end)';
    v_winner text;
    v_conflicts int8;
    v_inserted int8;
    v_deletes int8;
    v_updates int8;
    v_inserts int8;
    v_first record;
begin
    if to_regclass('pg_temp.pgcascade_peer_net') is null then
        create temp table pgcascade_peer_net (
            row_key jsonb, first_ev int8, first_type text, ev_type text, ev_data text, remote_time timestamptz,
            local_exists bool not null default false, local_row jsonb, local_xmin xid, local_xid xid8,
            rv_origin text, rv_tick int8, rv_time timestamptz, rv_xid xid8, rv_deleted bool,
            local_kind text, local_origin text, local_time timestamptz, seen bool, conflict text, winner text
        ) on commit delete rows;
    end if;
    delete from pg_temp.pgcascade_peer_net;  -- a few rows: TRUNCATE would cost a new file each call
    -- the net change per key: the last event wins; the first says how the peer's change began
    execute format(
        'insert into pg_temp.pgcascade_peer_net (row_key, first_ev, first_type, ev_type, ev_data, remote_time)'
        ' select distinct on (k) k, min(s.ev_id) over (partition by k),'
        '        first_value(s.ev_type) over (partition by k order by s.ev_id), s.ev_type, s.ev_data, s.ev_time'
        '   from pg_temp.pgcascade_stage s'
        '  cross join lateral json_populate_record(null::%s, s.ev_data::json) r'
        '  cross join lateral (select %s as k) kk'
        '  where s.ev_extra1 = $1 and s.ev_id >= $2 and s.ev_id < $3 and s.ev_type in (''I'', ''U'', ''D'')'
        '  order by k, s.ev_id desc', i_dest, v_key_r)
        using i_table, i_lo, i_hi;
    -- the local rows, locked first: a local transaction changing one after it was read here
    -- would otherwise be overwritten by a decision taken on the version before it
    execute format('select 1 from %s t join pg_temp.pgcascade_peer_net n on %s for update of t', i_dest, v_match);
    -- the local row, and its version
    execute format(
        'update pg_temp.pgcascade_peer_net n set local_exists = true, local_row = to_jsonb(t),'
        ' local_xmin = t.xmin, local_xid = pgcascade.xid8_of(t.xmin) from %s t where %s', i_dest, v_match);
    update pg_temp.pgcascade_peer_net n
       set (rv_origin, rv_tick, rv_time, rv_xid, rv_deleted) =
           (select origin, origin_tick, origin_time, xid, deleted from pgcascade.row_version v
             where v.table_name = i_table and v.row_key = n.row_key);
    -- a row as the first copy from a peer left it: that peer's, seen by every master, older
    -- than any change (pgcascade.peer_copy)
    update pg_temp.pgcascade_peer_net n
       set (rv_origin, rv_tick, rv_time, rv_xid, rv_deleted) = (c.origin, 0, '-infinity', c.xid, false)
      from pgcascade.peer_copy c
     where c.table_name = i_table and n.local_exists and c.xid = n.local_xid
       and n.rv_xid is distinct from n.local_xid;
    -- a key absent here since a TRUNCATE newer than its own tombstone: that TRUNCATE is its
    -- version (94_two_way_truncate.sql)
    update pg_temp.pgcascade_peer_net n
       set (rv_origin, rv_tick, rv_time, rv_xid, rv_deleted) =
           (nullif(t.origin, i_self), t.origin_tick, t.origin_time, t.xid, true)
      from pgcascade.truncate_version(i_table, i_self) t
     where not n.local_exists
       and (n.rv_xid is null or (t.origin_time, t.origin) > (coalesce(n.rv_time, pgcascade.commit_time(n.rv_xid),
                                                                       '-infinity'), coalesce(n.rv_origin, i_self)));
    update pg_temp.pgcascade_peer_net n set
        local_kind = case when n.local_exists and n.rv_xid = n.local_xid and not n.rv_deleted then 'peer'
                          when n.local_exists then 'local'
                          when n.rv_deleted and n.rv_origin is null then 'local'
                          when n.rv_deleted then 'peer' end,
        local_origin = case when n.local_exists and n.rv_xid = n.local_xid and not n.rv_deleted then n.rv_origin
                            when n.local_exists then i_self
                            when n.rv_deleted then coalesce(n.rv_origin, i_self) end,
        local_time = case when n.local_exists and n.rv_xid = n.local_xid and not n.rv_deleted then n.rv_time
                          when n.local_exists then pg_xact_commit_timestamp(n.local_xmin)
                          when n.rv_deleted and n.rv_origin is null then pgcascade.commit_time(n.rv_xid)
                          when n.rv_deleted then n.rv_time end;
    -- had the peer applied the local version when it made its change?  (The batch's markers
    -- first, apart: a look-up per row in the whole staged batch would grow with its square.)
    with m as materialized (
        select ev_id, ev_extra1, ev_data, ev_extra2 from pg_temp.pgcascade_stage
         where ev_type = 'pgcascade.peer-seen')
    update pg_temp.pgcascade_peer_net n set seen = case
        when n.local_kind is null or n.local_origin = i_peer then true
        when n.local_origin = i_self then coalesce(pg_visible_in_snapshot(
                 case when n.local_exists then n.local_xid else n.rv_xid end,
                 coalesce((select m.ev_extra2::pg_snapshot from m
                            where m.ev_extra1 = i_self and m.ev_id < n.first_ev
                            order by m.ev_id desc limit 1),
                          (select p.seen_snapshot from pgcascade.peer_seen p
                            where p.queue_name = i_peer_queue and p.origin = i_self))), false)
        else coalesce(n.rv_tick <= coalesce(
                 (select m.ev_data::int8 from m
                   where m.ev_extra1 = n.local_origin and m.ev_id < n.first_ev
                   order by m.ev_id desc limit 1),
                 (select p.seen_tick from pgcascade.peer_seen p
                   where p.queue_name = i_peer_queue and p.origin = n.local_origin)), false) end;
    update pg_temp.pgcascade_peer_net n set conflict = case
        when n.first_type = 'I' and n.local_exists then 'insert/insert'
        when n.ev_type = 'D' and not n.local_exists and n.first_type <> 'I' then 'delete/delete'
        when n.seen then null
        when n.local_exists and n.ev_type = 'D' then 'update/delete'
        when n.local_exists then 'update/update'
        when exists (select 1 from pgcascade.table_truncate t where t.table_name = i_table and t.xid = n.rv_xid)
            then 'update/truncate'
        else 'update/delete' end;
    -- who wins, by the policy
    v_winner := case
        when i_policy = 'apply-remote' then '''remote'''
        when i_policy = 'keep-local' then '''local'''
        when i_policy = 'last-update-wins' then format(v_lww, i_peer)
        when i_policy = 'first-update-wins' then format(v_fuw, i_peer)
        when i_policy like 'origin-wins:%' then format(
            '(case when %L = %L then ''remote'' when n.local_origin = %L then ''local'' else %s end)',
            i_peer, substr(i_policy, 13), substr(i_policy, 13), format(v_lww, i_peer))
        when i_policy like 'function:%' then format(
            '%s(n.conflict, %L::text, n.local_row, n.ev_data::jsonb, n.local_origin, %L::text, n.local_time, n.remote_time)',
            substr(i_policy, 10)::regproc, i_table, i_peer)
        when i_policy = 'error' then '''error'''
        else null end;
    if v_winner is null then
        raise exception 'unknown conflict policy "%"', i_policy using errcode = '22023';
    end if;
    execute format('update pg_temp.pgcascade_peer_net n set winner = case when n.conflict is null'
                   ' or n.conflict = ''delete/delete'' then ''remote'' else %s end', v_winner);
    select * into v_first from pg_temp.pgcascade_peer_net n
     where n.winner is distinct from 'remote' and n.winner is distinct from 'local' limit 1;
    if found then
        raise exception '% conflict on % key % from %: the policy is "%"', v_first.conflict, i_table,
            v_first.row_key, i_peer, i_policy using
            hint = 'change the policy (add-peer --conflict) or the row, then the worker goes on from this batch';
    end if;
    insert into pgcascade.conflict (queue_name, table_name, conflict_type, row_key, local_row, remote_row,
                                    local_origin, remote_origin, local_time, remote_time, policy, winner, tick_id)
    select i_peer_queue, i_table, n.conflict, n.row_key, n.local_row,
           case when n.ev_type <> 'D' then n.ev_data::jsonb end,
           n.local_origin, i_peer, n.local_time, n.remote_time, i_policy, n.winner, i_tick
      from pg_temp.pgcascade_peer_net n where n.conflict is not null;
    get diagnostics v_conflicts = row_count;
    -- apply the remote winners, and record their versions (a statement only for what has rows:
    -- a batch mostly inserts into some tables and updates others)
    select count(*) filter (where n.ev_type = 'D' and n.local_exists),
           count(*) filter (where n.ev_type <> 'D' and n.local_exists),
           count(*) filter (where n.ev_type <> 'D' and not n.local_exists)
      into v_deletes, v_updates, v_inserts
      from pg_temp.pgcascade_peer_net n where n.winner = 'remote';
    if v_deletes > 0 then
        execute format('delete from %s t using pg_temp.pgcascade_peer_net n'
                       ' where n.winner = ''remote'' and n.ev_type = ''D'' and n.local_exists and %s', i_dest, v_match);
    end if;
    if v_updates > 0 then
        execute format('update %s t set (%s) = (select %s) from pg_temp.pgcascade_peer_net n'
                       ' cross join lateral json_populate_record(%s, n.ev_data::json) r'
                       ' where n.winner = ''remote'' and n.ev_type <> ''D'' and n.local_exists and %s',
                       i_dest, v_cols, v_rcols, v_base, v_match);
    end if;
    if v_inserts > 0 then
        execute format('insert into %s (%s) select %s from pg_temp.pgcascade_peer_net n'
                       ' cross join lateral json_populate_record(%s, n.ev_data::json) r'
                       ' where n.winner = ''remote'' and n.ev_type <> ''D'' and not n.local_exists'
                       ' on conflict (%s) do nothing',
                       i_dest, v_cols, v_rcols, v_base,
                       array_to_string(array(select quote_ident(k) from unnest(i_keys) k), ', '));
        get diagnostics v_inserted = row_count;
        if v_inserted < v_inserts then
            -- a local insert of the same key came in after the rows were read: decide again
            raise exception 'a row of % was inserted here while a change of % to it was applied', i_table, i_peer
                using errcode = '40001', hint = 'the worker applies the batch again';
        end if;
    end if;
    insert into pgcascade.row_version as v (table_name, row_key, origin, origin_tick, origin_time, xid, deleted)
    select i_table, n.row_key, i_peer, i_tick, n.remote_time, pg_current_xact_id(), n.ev_type = 'D'
      from pg_temp.pgcascade_peer_net n where n.winner = 'remote'
    on conflict (table_name, row_key) do update
       set origin = excluded.origin, origin_tick = excluded.origin_tick, origin_time = excluded.origin_time,
           xid = excluded.xid, deleted = excluded.deleted;
    return v_conflicts;
end $$;

-- pgcascade.peer_batch_done(own_queue, peer_queue, peer, tick, tick_snapshot) -> void: after a
-- peer's batch is applied here, in its transaction: what the peer had applied of each origin
-- (the staged markers), and this master's own marker for its peers.
create or replace function pgcascade.peer_batch_done(
    i_own_queue text, i_peer_queue text, i_peer text, i_tick int8, i_snapshot text)
returns void
language plpgsql as $$
begin
    insert into pgcascade.peer_seen (queue_name, origin, seen_tick, seen_snapshot)
    select distinct on (ev_extra1) i_peer_queue, ev_extra1, ev_data::int8, ev_extra2::pg_snapshot
      from pg_temp.pgcascade_stage where ev_type = 'pgcascade.peer-seen'
     order by ev_extra1, ev_id desc
    on conflict (queue_name, origin) do update
       set seen_tick = excluded.seen_tick, seen_snapshot = excluded.seen_snapshot;
    -- only after changes: a batch of markers alone changed no row here, and answering it would
    -- make the masters send markers back and forth for ever
    if exists (select 1 from pg_temp.pgcascade_stage where ev_type not like 'pgcascade.%') then
        perform pgcascade.insert_event(i_own_queue, 'pgcascade.peer-seen', i_tick::text, i_peer, i_snapshot, null, null);
    end if;
end $$;

-- pgcascade.spread_sequence(seq, step, start) -> void: a two-way master's share of a sequence:
-- every step-th value from start on (its peers take the other residues).
create or replace function pgcascade.spread_sequence(i_seq regclass, i_step int4, i_start int8) returns void
language plpgsql as $$
begin
    execute format('alter sequence %s increment by %s', i_seq, i_step);
    perform setval(i_seq, i_start, false);
end $$;
