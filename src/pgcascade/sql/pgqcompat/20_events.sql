-- pgq compatibility, part 3: inserting events.

-- pgq.insert_event_raw(queue, ev_id, ev_time, ev_owner, ev_retry, type, data, extra1..4) -> ev_id.
-- PgQ's low-level insert (a C function there): a null ev_id takes the queue's next id, a null
-- ev_time now().  Refused while the queue has disable_insert set - except for a session in
-- session_replication_role = replica, which replays what another node already accepted - and
-- past the queue's queue_per_tx_limit events in one transaction.
create or replace function pgq.insert_event_raw(
    queue_name text, ev_id bigint, ev_time timestamptz, ev_owner integer, ev_retry integer,
    ev_type text, ev_data text, ev_extra1 text, ev_extra2 text, ev_extra3 text, ev_extra4 text)
returns int8
language plpgsql security definer set search_path = pg_catalog as $$
#variable_conflict use_variable
declare
    q pgcascade.queue;
    v_counter text;
    v_count int4;
    v_id int8;
begin
    if queue_name is null then
        raise exception 'Queue name must not be NULL';
    end if;
    select * into q from pgcascade.queue x where x.queue_name = queue_name;
    if not found then
        raise exception 'No such queue';
    end if;
    v_id := nextval(q.queue_event_seq);  -- taken first, even for an event refused or given an id, as PgQ does
    if q.queue_disable_insert and current_setting('session_replication_role') <> 'replica' then
        raise exception 'Insert into queue disallowed';
    end if;
    if q.queue_per_tx_limit is not null then
        -- a transaction-local setting counts this transaction's events for the queue
        v_counter := 'pgq_compat.tx_events_' || q.queue_id;
        v_count := coalesce(nullif(current_setting(v_counter, true), ''), '0')::int4 + 1;
        if v_count > q.queue_per_tx_limit then
            raise exception 'Queue ''%'' allows max % events from one TX', queue_name, q.queue_per_tx_limit;
        end if;
        perform set_config(v_counter, v_count::text, true);
    end if;
    insert into pgcascade.event (ev_id, ev_time, ev_part, ev_type, ev_data, ev_extra1, ev_rare)
    values (coalesce(ev_id, v_id), coalesce(ev_time, now()), q.queue_id * 16 + q.queue_cur_table, ev_type, ev_data, ev_extra1,
            case when coalesce(ev_extra2, ev_extra3, ev_extra4) is not null or ev_owner is not null
                      or ev_retry is not null
                 then row(ev_extra2, ev_extra3, ev_extra4, ev_retry, ev_owner)::pgcascade.event_rare end);
    return coalesce(ev_id, v_id);
end $$;

create or replace function pgq.insert_event(
    queue_name text, ev_type text, ev_data text, ev_extra1 text, ev_extra2 text, ev_extra3 text, ev_extra4 text)
returns int8
language sql security definer set search_path = pg_catalog as $$
    select pgq.insert_event_raw(queue_name, null, now(), null, null, ev_type, ev_data,
                                ev_extra1, ev_extra2, ev_extra3, ev_extra4)
$$;

create or replace function pgq.insert_event(queue_name text, ev_type text, ev_data text) returns int8
language sql security definer set search_path = pg_catalog as $$ select pgq.insert_event_raw(queue_name, null, now(), null, null, ev_type, ev_data, null, null, null, null) $$;
