-- pgcascade.queue_oldest_position(queue_id) -> the tick of the registration furthest behind
-- (consumers and watermarks alike), or null when nobody is registered.
create or replace function pgcascade.queue_oldest_position(i_queue_id int4) returns int8
language sql stable as $$
    select min(sub_last_tick) from pgcascade.subscription where sub_queue = i_queue_id
$$;

-- pgcascade.maint_rotate_tables(queue_name) -> 1 if the queue switched to its next event table.
-- When rotation_period has passed, the next slot is TRUNCATEd and becomes current - but only
-- once every registration has passed every event in it: under an ACCESS EXCLUSIVE lock
-- (no writer left in it), no row may be invisible in the oldest registration's tick snapshot.
-- Otherwise nothing happens and the next call tries again.  Batches read every slot, so the
-- old current slot stays readable as long as anybody needs it.
create or replace function pgcascade.maint_rotate_tables(i_queue_name text) returns int4
language plpgsql as $$
declare
    q pgcascade.queue;
    v_next int4;
    part text;
    v_pos int8;
    v_snap pg_snapshot;
    v_busy bool;
    v_old_timeout text := current_setting('lock_timeout');
begin
    select * into q from pgcascade.queue where queue_name = i_queue_name for update;
    if not found then
        perform pgcascade.find_queue(i_queue_name);
    end if;
    if now() - q.queue_switch_time < q.queue_rotation_period then
        return 0;
    end if;
    v_next := (q.queue_cur_table + 1) % q.queue_ntables;
    part := pgcascade.queue_part_name(q.queue_id, v_next);
    -- readers hold share locks on every partition; never queue them behind us for long
    perform set_config('lock_timeout', '200ms', true);
    begin
        execute format('lock table pgcascade.%I in access exclusive mode', part);
    exception when lock_not_available then
        perform set_config('lock_timeout', v_old_timeout, true);
        return 0;
    end;
    perform set_config('lock_timeout', v_old_timeout, true);
    v_pos := pgcascade.queue_oldest_position(q.queue_id);
    if v_pos is not null then
        select tick_snapshot into v_snap from pgcascade.tick where tick_queue = q.queue_id and tick_id = v_pos;
        execute format('select exists (select 1 from pgcascade.%I where ev_txid >= $1'
                       ' and not txid_visible_in_snapshot(ev_txid, $2::text::txid_snapshot))', part)
           into v_busy using pg_snapshot_xmin(v_snap)::text::int8, v_snap;
        if v_busy then
            return 0;
        end if;
    end if;
    execute format('truncate pgcascade.%I', part);
    update pgcascade.queue set queue_cur_table = v_next, queue_switch_time = now() where queue_id = q.queue_id;
    perform pgcascade.capture_refresh(i_queue_name);  -- the capture triggers write into the new partition
    return 1;
end $$;

-- pgcascade.maint_tick_cleanup(queue_name) -> ticks deleted: those before the oldest
-- registration's position (or all but the last one when nobody is registered).
create or replace function pgcascade.maint_tick_cleanup(i_queue_name text) returns int4
language plpgsql as $$
declare
    q pgcascade.queue;
    v_keep int8;
    n int4;
begin
    q := pgcascade.find_queue(i_queue_name);
    v_keep := coalesce(pgcascade.queue_oldest_position(q.queue_id),
                       (select max(tick_id) from pgcascade.tick where tick_queue = q.queue_id));
    delete from pgcascade.tick where tick_queue = q.queue_id and tick_id < v_keep;
    get diagnostics n = row_count;
    return n;
end $$;

-- pgcascade.maint_operations() -> (func_name, func_arg): the maintenance the ticker runs,
-- each call in a transaction of its own.  The database says what to do; the daemon obeys.
-- The global watermark goes first: rotation and cleanup wait behind it.  Partitions attached to
-- a captured partitioned table get their capture triggers (91_capture_partitions.sql); key-change
-- triggers are made again where their form no longer fits the table (92_key_triggers.sql).
create or replace function pgcascade.maint_operations(out func_name text, out func_arg text)
returns setof record
language sql stable as $$
    select f, queue_name from pgcascade.queue,
           unnest(array['pgcascade.maint_global_watermark', 'pgcascade.maint_rotate_tables',
                        'pgcascade.maint_tick_cleanup', 'pgcascade.maint_capture_partitions',
                        'pgcascade.maint_key_triggers']) f
    union all
    select 'pgcascade.maint_retry_events', null
$$;

-- pgcascade.maint_tables_to_vacuum() -> the small, often-updated tables the ticker vacuums.
-- Event tables are never vacuumed: they are only inserted into and truncated.
create or replace function pgcascade.maint_tables_to_vacuum() returns setof text
language sql stable as $$
    select unnest(array['pgcascade.queue', 'pgcascade.tick', 'pgcascade.subscription', 'pgcascade.retry_queue'])
$$;
